//! Token streams (`profile tokens`): token ids read from a text file (one
//! id per line) or a NumPy `.npy` array, and the distinct ids per batch of
//! consecutive tokens: the rows of an embedding table one rank's batch
//! touches, which the sparse embedding syncs move.

use super::TokenPoint;
use std::path::Path;

/// Batches of one size counted at most; spread evenly over the stream.
const MAX_BATCHES: usize = 256;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum TokenError {
    #[error("{path}: {message}")]
    Unreadable { path: String, message: String },
    #[error("{path}: {message}")]
    Malformed { path: String, message: String },
    #[error("{path}: no token ids; give a file with one id per line or a .npy array")]
    Empty { path: String },
    #[error(
        "{path}: token id {id} (at position {position}) is not below the vocabulary of {vocab}; give the tokenizer's vocabulary size"
    )]
    BeyondVocab {
        path: String,
        id: u64,
        position: usize,
        vocab: u64,
    },
}

/// The token ids of `path`, each checked below `vocab`: a NumPy `.npy`
/// array of integers (any integer dtype, little-endian, C order), or text
/// with one non-negative integer per line (blank lines skipped).
pub fn read_token_ids(path: &Path, vocab: u64) -> Result<Vec<u32>, TokenError> {
    let shown = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| TokenError::Unreadable {
        path: shown.clone(),
        message: e.to_string(),
    })?;
    let ids = if bytes.starts_with(b"\x93NUMPY") {
        parse_npy(&bytes).map_err(|message| TokenError::Malformed {
            path: shown.clone(),
            message,
        })?
    } else {
        parse_lines(&bytes).map_err(|message| TokenError::Malformed {
            path: shown.clone(),
            message,
        })?
    };
    if ids.is_empty() {
        return Err(TokenError::Empty { path: shown });
    }
    if let Some((position, &id)) = ids.iter().enumerate().find(|(_, id)| **id >= vocab) {
        return Err(TokenError::BeyondVocab {
            path: shown,
            id,
            position,
            vocab,
        });
    }
    // Below the vocabulary, which fits in u32 for every tokenizer in use.
    Ok(ids.into_iter().map(|id| id as u32).collect())
}

fn parse_lines(bytes: &[u8]) -> Result<Vec<u64>, String> {
    let text = std::str::from_utf8(bytes)
        .map_err(|_| "neither a .npy array nor text (it is not UTF-8)".to_string())?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            l.trim().parse::<u64>().map_err(|_| {
                format!(
                    "line {}: `{}` is not a non-negative integer token id",
                    i + 1,
                    l.trim().escape_debug()
                )
            })
        })
        .collect()
}

/// A version 1-3 `.npy` file of one integer dtype.
fn parse_npy(bytes: &[u8]) -> Result<Vec<u64>, String> {
    let major = *bytes.get(6).ok_or("a truncated .npy header")?;
    let (len, start) = match major {
        1 => {
            let b = bytes.get(8..10).ok_or("a truncated .npy header")?;
            (u16::from_le_bytes([b[0], b[1]]) as usize, 10)
        }
        2 | 3 => {
            let b = bytes.get(8..12).ok_or("a truncated .npy header")?;
            (u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize, 12)
        }
        v => return Err(format!(".npy version {v} is not one this reads (1 to 3)")),
    };
    let header = bytes
        .get(start..start + len)
        .ok_or("a truncated .npy header")?;
    let header = String::from_utf8_lossy(header);
    let field = |name: &str| -> Option<String> {
        let at = header.find(&format!("'{name}'"))? + name.len() + 2;
        let rest = header[at..].trim_start().strip_prefix(':')?.trim_start();
        Some(rest.to_string())
    };
    let descr = field("descr").ok_or("the .npy header has no descr")?;
    let descr = descr
        .trim_start_matches(['\'', '"'])
        .split(['\'', '"'])
        .next()
        .unwrap_or("");
    if field("fortran_order").is_some_and(|f| f.starts_with("True")) {
        return Err("a Fortran-ordered .npy array; save it with C order".into());
    }
    let (signed, width) = match descr {
        "<i1" | "|i1" => (true, 1),
        "<u1" | "|u1" => (false, 1),
        "<i2" => (true, 2),
        "<u2" => (false, 2),
        "<i4" => (true, 4),
        "<u4" => (false, 4),
        "<i8" => (true, 8),
        "<u8" => (false, 8),
        other => {
            return Err(format!(
                "dtype `{}` is not a little-endian integer; save the token ids as int32, uint16 or int64",
                other.escape_debug()
            ));
        }
    };
    let data = &bytes[start + len..];
    if !data.len().is_multiple_of(width) {
        return Err(format!(
            "{} data bytes are not a whole number of {width}-byte ids",
            data.len()
        ));
    }
    data.chunks_exact(width)
        .enumerate()
        .map(|(i, chunk)| {
            let mut raw = [0u8; 8];
            raw[..width].copy_from_slice(chunk);
            let unsigned = u64::from_le_bytes(raw);
            let value = if signed {
                let shift = 64 - 8 * width as u32;
                ((unsigned << shift) as i64) >> shift
            } else {
                unsigned as i64
            };
            u64::try_from(value).map_err(|_| format!("id {value} at position {i} is negative"))
        })
        .collect()
}

/// Distinct ids in batches of each size of `batch_tokens` (consecutive
/// ids; up to [`MAX_BATCHES`] batches spread over the stream), as profile
/// points. Sizes beyond the stream are left out.
pub fn distinct_per_batch(ids: &[u32], vocab: u64, batch_tokens: &[u64]) -> Vec<TokenPoint> {
    // A stamp per id: the batch that saw it last, so no set is rebuilt.
    let mut seen = vec![0u32; vocab as usize];
    let mut stamp = 0u32;
    let mut points = Vec::new();
    for &size in batch_tokens {
        let size_usize = size as usize;
        if size == 0 || size_usize > ids.len() {
            continue;
        }
        let whole = ids.len() / size_usize;
        let batches = whole.min(MAX_BATCHES);
        let mut total = 0u64;
        for b in 0..batches {
            // Evenly spaced over the whole batches of the stream.
            let index = b * whole / batches;
            stamp += 1;
            let mut distinct = 0u64;
            for &id in &ids[index * size_usize..(index + 1) * size_usize] {
                let slot = &mut seen[id as usize];
                if *slot != stamp {
                    *slot = stamp;
                    distinct += 1;
                }
            }
            total += distinct;
        }
        points.push(TokenPoint {
            vocab,
            tokens: size,
            distinct: total as f64 / batches as f64,
            batches: batches as u64,
        });
    }
    points
}

/// Powers of two from 1 to the stream's length.
pub fn default_batch_sizes(tokens: usize) -> Vec<u64> {
    std::iter::successors(Some(1u64), |n| n.checked_mul(2))
        .take_while(|&n| n as usize <= tokens)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn npy(descr: &str, data: &[u8]) -> Vec<u8> {
        let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': (3,), }}");
        while (10 + header.len() + 1) % 64 != 0 {
            header.push(' ');
        }
        header.push('\n');
        let mut out = b"\x93NUMPY\x01\x00".to_vec();
        out.extend((header.len() as u16).to_le_bytes());
        out.extend(header.as_bytes());
        out.extend(data);
        out
    }

    #[test]
    fn npy_arrays_of_each_integer_width_read_back() {
        assert_eq!(
            parse_npy(&npy("<u2", &[1, 0, 2, 0, 255, 255])).unwrap(),
            [1, 2, 65535]
        );
        let i4: Vec<u8> = [7i32, 0, 9].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(parse_npy(&npy("<i4", &i4)).unwrap(), [7, 0, 9]);
        let i8: Vec<u8> = [1i64, -1, 3].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert!(
            parse_npy(&npy("<i8", &i8))
                .unwrap_err()
                .contains("negative")
        );
        assert!(
            parse_npy(&npy("<f4", &[0; 12]))
                .unwrap_err()
                .contains("dtype")
        );
        assert!(
            parse_npy(b"\x93NUMPY\x01")
                .unwrap_err()
                .contains("truncated")
        );
    }

    #[test]
    fn text_ids_read_and_bad_lines_are_named() {
        assert_eq!(parse_lines(b"3\n\n 4 \n5\n").unwrap(), [3, 4, 5]);
        assert!(parse_lines(b"3\nfour\n").unwrap_err().starts_with("line 2"));
    }

    #[test]
    fn distinct_ids_are_counted_per_batch() {
        let ids = [0, 1, 0, 1, 2, 2, 2, 2];
        let points = distinct_per_batch(&ids, 3, &[1, 2, 4, 16]);
        let got: Vec<(u64, f64)> = points.iter().map(|p| (p.tokens, p.distinct)).collect();
        assert_eq!(got, [(1, 1.0), (2, 1.5), (4, 1.5)]);
        assert!(points.iter().all(|p| p.check().is_ok()));
    }
}
