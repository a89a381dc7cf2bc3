//! Quantities that carry units on input: bandwidths and memory sizes.
//! A bare number is an error, because "100" could mean GB/s or Gb/s.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::str::FromStr;

/// Bytes per second.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
pub struct Bandwidth(pub f64);

impl Bandwidth {
    pub fn bytes_per_s(self) -> f64 {
        self.0
    }
}

impl fmt::Display for Bandwidth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}GB/s", trim(self.0 / 1e9))
    }
}

fn trim(x: f64) -> String {
    let s = format!("{x:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// Parses `150GB/s`, `25 GiB/s`, `200Gb/s`, `8x200Gb/s` (a count of links
/// times the bandwidth of each), `1.6Tb/s`, `600 MB/s`.
impl FromStr for Bandwidth {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let compact: String = text.chars().filter(|c| !c.is_whitespace()).collect();
        let (count, rest) = match compact.split_once(['x', 'X', '*']) {
            Some((n, rest)) if !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()) => {
                (n.parse::<f64>().map_err(|_| bad_bandwidth(text))?, rest)
            }
            _ => (1.0, compact.as_str()),
        };
        let (number, unit) = split_number(rest).ok_or_else(|| bad_bandwidth(text))?;
        let value: f64 = number.parse().map_err(|_| bad_bandwidth(text))?;
        let per_second = unit
            .strip_suffix("/s")
            .or_else(|| unit.strip_suffix("ps"))
            .ok_or_else(|| bad_bandwidth(text))?;
        let scale = match per_second {
            "B" => 1.0,
            "KB" | "kB" => 1e3,
            "MB" => 1e6,
            "GB" => 1e9,
            "TB" => 1e12,
            "KiB" => 1024.0,
            "MiB" => 1024.0 * 1024.0,
            "GiB" => 1024.0 * 1024.0 * 1024.0,
            "b" => 1.0 / 8.0,
            "Kb" | "kb" => 1e3 / 8.0,
            "Mb" => 1e6 / 8.0,
            "Gb" => 1e9 / 8.0,
            "Tb" => 1e12 / 8.0,
            _ => return Err(bad_bandwidth(text)),
        };
        let bytes = plausible(text, count * value * scale, "/s", "150GB/s")?;
        Ok(Bandwidth(bytes))
    }
}

/// `bytes` (per second, with `per` "/s") where it is above zero and from a
/// kilobyte to a petabyte: beyond, a unit or an exponent went wrong, and
/// the times would overflow. `example` is what to give instead.
fn plausible(text: &str, bytes: f64, per: &str, example: &str) -> Result<f64, String> {
    if bytes == 0.0 {
        return Err(format!(
            "`{text}` is zero; give an amount above it, e.g. `{example}`"
        ));
    }
    if !(1e3..=1e15).contains(&bytes) {
        return Err(format!(
            "`{text}` is outside 1kB{per} to 1PB{per}; check the number and its unit, e.g. `{example}`"
        ));
    }
    Ok(bytes)
}

/// Splits `text` into its leading decimal number (digits, a point, an
/// exponent such as `e3`) and the unit after it; none without a unit.
fn split_number(text: &str) -> Option<(&str, &str)> {
    let bytes = text.as_bytes();
    let mut end = bytes
        .iter()
        .position(|c| !(c.is_ascii_digit() || *c == b'.'))?;
    // An exponent: `e`, an optional sign, then digits (no unit starts so).
    if matches!(bytes[end], b'e' | b'E') {
        let mut i = end + 1;
        if matches!(bytes.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        let digits = bytes[i..].iter().take_while(|c| c.is_ascii_digit()).count();
        if digits > 0 {
            end = i + digits;
        }
    }
    (end < bytes.len()).then(|| text.split_at(end))
}

fn bad_bandwidth(text: &str) -> String {
    if text.trim_start().starts_with('-') {
        return format!("`{text}` is negative; give a bandwidth above zero, e.g. `150GB/s`");
    }
    format!(
        "`{text}` is not a bandwidth: give a number with a unit, e.g. `150GB/s`, `25GiB/s`, \
         `200Gb/s` (bits) or `8x200Gb/s` (links x per-link)"
    )
}

impl Serialize for Bandwidth {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Bandwidth {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d).map_err(|_| {
            serde::de::Error::custom("a bandwidth must be a string with a unit, e.g. \"150GB/s\"")
        })?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// Bytes, parsed from `80GiB`, `40GB`, `512MiB`.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
pub struct Bytes(pub f64);

impl FromStr for Bytes {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let compact: String = text.chars().filter(|c| !c.is_whitespace()).collect();
        let (number, unit) = split_number(&compact).ok_or_else(|| bad_bytes(text))?;
        let value: f64 = number.parse().map_err(|_| bad_bytes(text))?;
        let scale = match unit {
            "B" => 1.0,
            "KB" | "kB" => 1e3,
            "MB" => 1e6,
            "GB" => 1e9,
            "TB" => 1e12,
            "KiB" => 1024.0,
            "MiB" => 1024.0 * 1024.0,
            "GiB" => 1024.0 * 1024.0 * 1024.0,
            "TiB" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
            _ => return Err(bad_bytes(text)),
        };
        let bytes = plausible(text, value * scale, "", "80GiB")?;
        Ok(Bytes(bytes))
    }
}

fn bad_bytes(text: &str) -> String {
    if text.trim_start().starts_with('-') {
        return format!("`{text}` is negative; give a size above zero, e.g. `80GiB`");
    }
    format!("`{text}` is not a memory size: give a number with a unit, e.g. `80GiB` or `40GB`")
}

impl Serialize for Bytes {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{}GiB", trim(self.0 / (1024.0 * 1024.0 * 1024.0))))
    }
}

impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d).map_err(|_| {
            serde::de::Error::custom("a memory size must be a string with a unit, e.g. \"80GiB\"")
        })?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// `1.23 s`, or `12.3 ms` below a second.
pub fn seconds(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.2} s")
    } else {
        format!("{:.1} ms", s * 1e3)
    }
}

/// A whole number with thousands separators: `1,234,567`.
pub fn thousands(x: f64) -> String {
    let digits = format!("{:.0}", x);
    let mut out = String::new();
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// A fraction as a percentage with one decimal: `12.3%`.
pub fn percent(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bandwidths_parse_with_their_units() {
        let gb = |t: &str| t.parse::<Bandwidth>().unwrap().0 / 1e9;
        assert_eq!(gb("150GB/s"), 150.0);
        assert_eq!(gb("200Gb/s"), 25.0);
        assert_eq!(gb("8x200Gb/s"), 200.0);
        assert_eq!(gb("8 x 200 Gb/s"), 200.0);
        assert!((gb("1GiB/s") - 1.073741824).abs() < 1e-12);
    }

    #[test]
    fn a_bare_number_is_not_a_bandwidth() {
        let err = "150".parse::<Bandwidth>().unwrap_err();
        assert!(err.contains("150GB/s"), "{err}");
        assert!("150GB".parse::<Bandwidth>().is_err());
        assert!("-5GB/s".parse::<Bandwidth>().is_err());
        assert!("fastGB/s".parse::<Bandwidth>().is_err());
    }

    #[test]
    fn memory_sizes_parse_with_their_units() {
        assert_eq!(
            "80GiB".parse::<Bytes>().unwrap().0,
            80.0 * 1024.0_f64.powi(3)
        );
        assert!("80".parse::<Bytes>().is_err());
        assert_eq!("1e3MB".parse::<Bytes>().unwrap().0, 1e9);
    }

    /// Zero is refused as zero, not as a missing unit; an exponent is a
    /// number's.
    #[test]
    fn zero_and_exponents_read_as_what_they_are() {
        let zero = "0GiB".parse::<Bytes>().unwrap_err();
        assert!(zero.contains("is zero") && zero.contains("80GiB"), "{zero}");
        let zero = "0GB/s".parse::<Bandwidth>().unwrap_err();
        assert!(
            zero.contains("is zero") && zero.contains("150GB/s"),
            "{zero}"
        );
        assert_eq!("1e3GB/s".parse::<Bandwidth>().unwrap().0, 1e12);
        assert_eq!("2.5E-1TB/s".parse::<Bandwidth>().unwrap().0, 2.5e11);
        assert!("1eGB/s".parse::<Bandwidth>().is_err());
        // Out of all reason, or signed: said so.
        for text in ["1e-300GB/s", "1e999GB/s"] {
            let err = text.parse::<Bandwidth>().unwrap_err();
            assert!(err.contains("outside"), "{err}");
        }
        let err = "1e999GB".parse::<Bytes>().unwrap_err();
        assert!(err.contains("outside"), "{err}");
        let err = "-0GB".parse::<Bytes>().unwrap_err();
        assert!(err.contains("negative"), "{err}");
    }
}
