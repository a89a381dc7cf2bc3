//! SVG charts of a validation: memory per stage against the device capacity,
//! and iteration time per candidate with its predicted band. Each function
//! returns the SVG document as a string; writing it is the caller's business.
//!
//! Text is left to the SVG viewer's fonts (plotters' SVG backend writes
//! `<text>` elements), so no font is read here.

use super::{GIB, ReportError};
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint};
use plotters::prelude::*;

/// One bar group of the memory chart: a pipeline stage of a candidate.
#[derive(Debug, Clone, PartialEq)]
pub struct StageMemoryBar {
    /// What the x axis says under the group, e.g. `#1 stage 0`.
    pub label: String,
    pub predicted_bytes: f64,
    /// Peak bytes measured on the stage, if the trial got that far.
    pub measured_bytes: Option<f64>,
}

/// One candidate of the time chart.
#[derive(Debug, Clone, PartialEq)]
pub struct CandidateTime {
    /// What the x axis says under the candidate, e.g. `#1 tp2 pp4`.
    pub label: String,
    /// Predicted time (an iteration, or a stage's micro-batch), seconds.
    pub predicted_s: f64,
    /// The predicted band (low, high) in seconds, drawn as an error bar.
    pub band_s: Option<(f64, f64)>,
    /// Measured time, seconds.
    pub measured_s: Option<f64>,
}

const PREDICTED: RGBColor = RGBColor(31, 119, 180);
const MEASURED: RGBColor = RGBColor(255, 127, 14);
const CAPACITY: RGBColor = RGBColor(214, 39, 40);
const BAND: RGBColor = RGBColor(40, 40, 40);

const HEIGHT: u32 = 440;

/// Width that leaves each group of bars room for its label.
fn width_for(groups: usize) -> u32 {
    (160 + 110 * groups as u32).clamp(640, 4000)
}

/// Checks that a value can be drawn: finite and not negative.
fn drawable(
    chart: &'static str,
    label: &str,
    field: &'static str,
    value: f64,
) -> Result<f64, ReportError> {
    if !value.is_finite() {
        return Err(ReportError::NotFinite {
            chart,
            label: label.to_string(),
            field,
            value,
        });
    }
    if value < 0.0 {
        return Err(ReportError::Invalid {
            chart,
            label: label.to_string(),
            message: format!("its {field} is {value}, below zero"),
        });
    }
    Ok(value)
}

fn draw_error<E: std::error::Error + Send + Sync>(
    chart: &'static str,
) -> impl Fn(DrawingAreaErrorKind<E>) -> ReportError {
    move |e| ReportError::Draw {
        chart,
        message: e.to_string(),
    }
}

/// The category axis: one slot per label, centred on 0, 1, 2, ..., with a
/// tick and the label at each and no light grid lines. Positions in
/// between place the bars of a group side by side.
struct Categories {
    count: usize,
}

impl Ranged for Categories {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        let range = self.range();
        let share = (value - range.start) / (range.end - range.start);
        limit.0 + (share * f64::from(limit.1 - limit.0)).round() as i32
    }

    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        if hint.weight().allow_light_points() {
            return Vec::new();
        }
        (0..self.count).map(|i| i as f64).collect()
    }

    fn range(&self) -> std::ops::Range<f64> {
        -0.5..self.count as f64 - 0.5
    }
}

/// The label of the slot at `x`, for tick positions only.
fn label_at(labels: &[&str], x: f64) -> String {
    let i = x.round();
    if i >= 0.0 && (x - i).abs() < 1e-6 {
        labels
            .get(i as usize)
            .map(|s| s.to_string())
            .unwrap_or_default()
    } else {
        String::new()
    }
}

/// Grouped bars per stage: predicted bytes and, where measured, measured
/// bytes, in GiB, with a horizontal line at the device capacity.
type Canvas<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;
type Chart<'a, 'b> = ChartContext<
    'a,
    SVGBackend<'b>,
    Cartesian2d<Categories, plotters::coord::types::RangedCoordf64>,
>;
type DrawResult<T> =
    Result<T, DrawingAreaErrorKind<<SVGBackend<'static> as DrawingBackend>::ErrorType>>;

/// The frame both charts share: white canvas, title, one category per
/// label on x, `0..top` on y, light horizontal grid.
struct Axes<'l> {
    title: &'l str,
    labels: &'l [&'l str],
    top: f64,
    x_desc: &'l str,
    y_desc: &'l str,
}

impl Axes<'_> {
    fn draw<'a, 'b>(&self, root: &'a Canvas<'b>) -> DrawResult<Chart<'a, 'b>> {
        root.fill(&WHITE)?;
        let x_axis = Categories {
            count: self.labels.len(),
        };
        let mut chart = ChartBuilder::on(root)
            .caption(self.title, ("sans-serif", 20))
            .margin(15)
            .x_label_area_size(45)
            .y_label_area_size(70)
            .build_cartesian_2d(x_axis, 0.0..self.top)?;
        let formatter = |x: &f64| label_at(self.labels, *x);
        chart
            .configure_mesh()
            .disable_x_mesh()
            .max_light_lines(1)
            .x_desc(self.x_desc)
            .y_desc(self.y_desc)
            .x_label_formatter(&formatter)
            .draw()?;
        Ok(chart)
    }
}

/// The series legend, top right.
fn draw_legend<'a, 'b: 'a>(chart: &mut Chart<'a, 'b>) -> DrawResult<()> {
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
}

pub fn memory_chart(
    title: &str,
    stages: &[StageMemoryBar],
    capacity_bytes: f64,
) -> Result<String, ReportError> {
    const CHART: &str = "memory";
    if stages.is_empty() {
        return Err(ReportError::Empty {
            chart: CHART,
            what: "no stages were given".into(),
        });
    }
    let capacity = drawable(CHART, "capacity", "capacity", capacity_bytes)? / GIB;
    let mut top = capacity;
    for stage in stages {
        top = top.max(
            drawable(
                CHART,
                &stage.label,
                "predicted bytes",
                stage.predicted_bytes,
            )? / GIB,
        );
        if let Some(measured) = stage.measured_bytes {
            top = top.max(drawable(CHART, &stage.label, "measured bytes", measured)? / GIB);
        }
    }
    // Headroom above the tallest bar for the legend.
    let top = if top > 0.0 { top * 1.3 } else { 1.0 };
    let any_measured = stages.iter().any(|s| s.measured_bytes.is_some());
    let labels: Vec<&str> = stages.iter().map(|s| s.label.as_str()).collect();
    let n = stages.len() as f64;
    let err = draw_error(CHART);

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width_for(stages.len()), HEIGHT))
            .into_drawing_area();
        let axes = Axes {
            title,
            labels: &labels,
            top,
            x_desc: "candidate and pipeline stage",
            y_desc: "memory per GPU (GiB)",
        };
        let mut chart = axes.draw(&root).map_err(&err)?;

        // With measurements the predicted bar takes the left half of the
        // slot and the measured one the right half.
        const BAR: f64 = 0.36;
        let predicted_right = if any_measured { 0.0 } else { BAR };
        chart
            .draw_series(stages.iter().enumerate().map(|(i, s)| {
                let x = i as f64;
                Rectangle::new(
                    [
                        (x - BAR, 0.0),
                        (x + predicted_right, s.predicted_bytes / GIB),
                    ],
                    PREDICTED.filled(),
                )
            }))
            .map_err(&err)?
            .label("predicted")
            .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], PREDICTED.filled()));
        if any_measured {
            chart
                .draw_series(stages.iter().enumerate().filter_map(|(i, s)| {
                    let x = i as f64;
                    s.measured_bytes
                        .map(|m| Rectangle::new([(x, 0.0), (x + BAR, m / GIB)], MEASURED.filled()))
                }))
                .map_err(&err)?
                .label("measured")
                .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], MEASURED.filled()));
        }
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(-0.5, capacity), (n - 0.5, capacity)],
                CAPACITY.stroke_width(2),
            )))
            .map_err(&err)?
            .label(format!("capacity ({capacity:.1} GiB)"))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], CAPACITY.stroke_width(2)));
        draw_legend(&mut chart).map_err(&err)?;
        root.present().map_err(&err)?;
    }
    Ok(svg)
}

/// Per candidate: the predicted time as a bar with its band as an error
/// bar, and the measured time as a point. The axis is in milliseconds when
/// every time is under a second, else in seconds.
pub fn time_chart(title: &str, candidates: &[CandidateTime]) -> Result<String, ReportError> {
    const CHART: &str = "time";
    if candidates.is_empty() {
        return Err(ReportError::Empty {
            chart: CHART,
            what: "no candidates were given".into(),
        });
    }
    let mut top: f64 = 0.0;
    for c in candidates {
        top = top.max(drawable(CHART, &c.label, "predicted time", c.predicted_s)?);
        if let Some((low, high)) = c.band_s {
            let low = drawable(CHART, &c.label, "band low", low)?;
            let high = drawable(CHART, &c.label, "band high", high)?;
            if low > high {
                return Err(ReportError::Invalid {
                    chart: CHART,
                    label: c.label.clone(),
                    message: format!(
                        "its band runs from {low} s down to {high} s; give (low, high)"
                    ),
                });
            }
            top = top.max(high);
        }
        if let Some(measured) = c.measured_s {
            top = top.max(drawable(CHART, &c.label, "measured time", measured)?);
        }
    }
    let (scale, unit) = if top < 1.0 { (1e3, "ms") } else { (1.0, "s") };
    let top = if top > 0.0 { top * scale * 1.3 } else { 1.0 };
    let any_band = candidates.iter().any(|c| c.band_s.is_some());
    let any_measured = candidates.iter().any(|c| c.measured_s.is_some());
    let labels: Vec<&str> = candidates.iter().map(|c| c.label.as_str()).collect();
    let err = draw_error(CHART);

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width_for(candidates.len()), HEIGHT))
            .into_drawing_area();
        let y_desc = format!("time ({unit})");
        let axes = Axes {
            title,
            labels: &labels,
            top,
            x_desc: "candidate (and stage)",
            y_desc: &y_desc,
        };
        let mut chart = axes.draw(&root).map_err(&err)?;

        chart
            .draw_series(candidates.iter().enumerate().map(|(i, c)| {
                let x = i as f64;
                Rectangle::new(
                    [(x - 0.3, 0.0), (x + 0.3, c.predicted_s * scale)],
                    PREDICTED.mix(0.75).filled(),
                )
            }))
            .map_err(&err)?
            .label("predicted")
            .legend(|(x, y)| {
                Rectangle::new([(x, y - 5), (x + 14, y + 5)], PREDICTED.mix(0.75).filled())
            });
        if any_band {
            let whisker = 0.12;
            chart
                .draw_series(candidates.iter().enumerate().filter_map(|(i, c)| {
                    let (low, high) = c.band_s?;
                    let (x, low, high) = (i as f64, low * scale, high * scale);
                    // One polyline per error bar: the low whisker, up the
                    // stem, the high whisker.
                    Some(PathElement::new(
                        vec![
                            (x - whisker, low),
                            (x + whisker, low),
                            (x, low),
                            (x, high),
                            (x - whisker, high),
                            (x + whisker, high),
                        ],
                        BAND.stroke_width(2),
                    ))
                }))
                .map_err(&err)?
                .label("predicted band")
                .legend(|(x, y)| {
                    PathElement::new(
                        vec![
                            (x + 3, y - 6),
                            (x + 11, y - 6),
                            (x + 7, y - 6),
                            (x + 7, y + 6),
                            (x + 3, y + 6),
                            (x + 11, y + 6),
                        ],
                        BAND.stroke_width(2),
                    )
                });
        }
        if any_measured {
            chart
                .draw_series(candidates.iter().enumerate().filter_map(|(i, c)| {
                    c.measured_s
                        .map(|m| Circle::new((i as f64, m * scale), 6, MEASURED.filled()))
                }))
                .map_err(&err)?
                .label("measured")
                .legend(|(x, y)| Circle::new((x + 7, y), 6, MEASURED.filled()));
        }
        draw_legend(&mut chart).map_err(&err)?;
        root.present().map_err(&err)?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The colour of a series as the SVG backend writes it.
    fn hex(c: RGBColor) -> String {
        format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2)
    }

    /// Elements of kind `tag` filled or stroked with `color`.
    fn count(svg: &str, tag: &str, color: RGBColor) -> usize {
        let color = hex(color);
        svg.split('<')
            .filter(|e| e.starts_with(tag) && e.contains(&color))
            .count()
    }

    fn stages() -> Vec<StageMemoryBar> {
        vec![
            StageMemoryBar {
                label: "#1 stage 0".into(),
                predicted_bytes: 60.0 * GIB,
                measured_bytes: Some(62.5 * GIB),
            },
            StageMemoryBar {
                label: "#1 stage 3".into(),
                predicted_bytes: 48.0 * GIB,
                measured_bytes: None,
            },
            StageMemoryBar {
                label: "#2 stage 0".into(),
                predicted_bytes: 75.0 * GIB,
                measured_bytes: Some(81.0 * GIB),
            },
        ]
    }

    fn candidates() -> Vec<CandidateTime> {
        vec![
            CandidateTime {
                label: "#1 tp2 pp4".into(),
                predicted_s: 0.42,
                band_s: Some((0.38, 0.47)),
                measured_s: Some(0.45),
            },
            CandidateTime {
                label: "#2 tp4 pp2".into(),
                predicted_s: 0.48,
                band_s: Some((0.43, 0.54)),
                measured_s: None,
            },
            CandidateTime {
                label: "#3 tp8".into(),
                predicted_s: 0.55,
                band_s: None,
                measured_s: Some(0.61),
            },
        ]
    }

    #[test]
    fn the_memory_chart_has_a_bar_per_value_a_capacity_line_and_a_legend() {
        let svg = memory_chart("Memory per stage", &stages(), 80.0 * GIB).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..80]);
        assert!(svg.trim_end().ends_with("</svg>"));
        for text in [
            "Memory per stage",
            "#1 stage 0",
            "#1 stage 3",
            "#2 stage 0",
            "predicted",
            "measured",
            "capacity (80.0 GiB)",
            "memory per GPU (GiB)",
        ] {
            assert!(svg.contains(text), "missing `{text}`");
        }
        // One bar per value plus the legend's swatch.
        assert_eq!(count(&svg, "rect", PREDICTED), 3 + 1);
        assert_eq!(count(&svg, "rect", MEASURED), 2 + 1);
        // The capacity line and its legend sample.
        assert_eq!(count(&svg, "polyline", CAPACITY), 1 + 1);
    }

    #[test]
    fn a_memory_chart_without_measurements_still_renders() {
        let mut stages = stages();
        for s in &mut stages {
            s.measured_bytes = None;
        }
        let svg = memory_chart("Predicted only", &stages, 80.0 * GIB).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("#2 stage 0"));
        assert_eq!(count(&svg, "rect", PREDICTED), 3 + 1);
        assert_eq!(count(&svg, "rect", MEASURED), 0);
        assert!(!svg.contains(">measured<"));
    }

    #[test]
    fn the_time_chart_has_bars_error_bars_points_and_picks_its_unit() {
        let svg = time_chart("Iteration time", &candidates()).unwrap();
        assert!(svg.starts_with("<svg"));
        for text in [
            "Iteration time",
            "#1 tp2 pp4",
            "#2 tp4 pp2",
            "#3 tp8",
            "predicted",
            "predicted band",
            "measured",
            "time (ms)",
        ] {
            assert!(svg.contains(text), "missing `{text}`");
        }
        assert_eq!(count(&svg, "rect", PREDICTED), 3 + 1);
        assert_eq!(count(&svg, "polyline", BAND), 2 + 1);
        assert_eq!(count(&svg, "circle", MEASURED), 2 + 1);

        let mut slow = candidates();
        for c in &mut slow {
            c.predicted_s *= 10.0;
        }
        let svg = time_chart("Slow", &slow).unwrap();
        assert!(svg.contains("time (s)"));
    }

    #[test]
    fn a_time_chart_without_measurements_or_bands_still_renders() {
        let mut cands = candidates();
        for c in &mut cands {
            c.measured_s = None;
            c.band_s = None;
        }
        let svg = time_chart("Predicted only", &cands).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("#3 tp8"));
        assert_eq!(count(&svg, "circle", MEASURED), 0);
        assert_eq!(count(&svg, "polyline", BAND), 0);
    }

    #[test]
    fn empty_input_and_bad_numbers_are_typed_errors_naming_the_label() {
        assert!(matches!(
            memory_chart("m", &[], 1.0),
            Err(ReportError::Empty { .. })
        ));
        assert!(matches!(
            time_chart("t", &[]),
            Err(ReportError::Empty { .. })
        ));

        let mut bad = stages();
        bad[1].measured_bytes = Some(f64::NAN);
        let err = memory_chart("m", &bad, 80.0 * GIB).unwrap_err();
        assert!(matches!(err, ReportError::NotFinite { .. }));
        assert!(err.to_string().contains("#1 stage 3"), "{err}");

        let err = memory_chart("m", &stages(), f64::INFINITY).unwrap_err();
        assert!(err.to_string().contains("capacity"), "{err}");

        let mut bad = candidates();
        bad[2].predicted_s = f64::INFINITY;
        let err = time_chart("t", &bad).unwrap_err();
        assert!(err.to_string().contains("#3 tp8"), "{err}");

        let mut bad = candidates();
        bad[0].band_s = Some((0.5, 0.4));
        let err = time_chart("t", &bad).unwrap_err();
        assert!(matches!(err, ReportError::Invalid { .. }));
        assert!(err.to_string().contains("#1 tp2 pp4"), "{err}");
    }

    #[test]
    fn labels_are_escaped_in_the_svg() {
        let mut stages = stages();
        stages[0].label = "a<b & c".into();
        let svg = memory_chart("m", &stages, 80.0 * GIB).unwrap();
        assert!(svg.contains("a&lt;b &amp; c"));
        assert!(!svg.contains("a<b"));
    }
}
