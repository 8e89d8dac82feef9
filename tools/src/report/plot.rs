//! The report's SVG plots (plotters' SVG backend: text is written as SVG
//! `<text>` for the viewer to render, so no font files are needed here).

use plotters::element::{DashedPathElement, ErrorBar};
use plotters::prelude::*;

use crate::backend::Backend;
use crate::bench::{Mode, ResultLine};

const W: u32 = 760;
const H: u32 = 480;

/// One colour per backend, the same in every chart (a backend's place in
/// the list would change with `--backends`).
pub fn backend_color(name: &str) -> RGBColor {
    match name {
        "raw" => RGBColor(90, 90, 90),
        "tcp" => RGBColor(31, 119, 180),
        "uring" => RGBColor(214, 39, 40),
        "grpc" => RGBColor(44, 160, 44),
        "dpdk" => RGBColor(148, 103, 189),
        "verbs" => RGBColor(255, 127, 14),
        "inproc" => RGBColor(140, 86, 75),
        other => {
            // A backend this table does not know yet still keeps one
            // colour: picked by its name.
            const MORE: [RGBColor; 4] = [
                RGBColor(23, 190, 207),
                RGBColor(188, 189, 34),
                RGBColor(227, 119, 194),
                RGBColor(127, 127, 127),
            ];
            let h = other
                .bytes()
                .fold(0usize, |h, b| h.wrapping_mul(31) + b as usize);
            MORE[h % MORE.len()]
        }
    }
}

/// The lighter shade of a backend's colour (unfused bars).
fn light(c: RGBColor) -> RGBColor {
    let l = |v: u8| (f64::from(v) + (255.0 - f64::from(v)) * 0.55) as u8;
    RGBColor(l(c.0), l(c.1), l(c.2))
}

fn err(e: impl std::fmt::Display) -> String {
    format!("drawing a plot: {e}")
}

/// One line of a line chart.
struct Line {
    label: String,
    color: RGBColor,
    dashed: bool,
    /// (x, y), y > 0, sorted by x.
    pts: Vec<(f64, f64)>,
}

/// A line per backend that has points: `y` against `x` of its `mode`
/// results, in the backend's colour, labelled `backend` + `suffix`.
fn lines_of(
    results: &[ResultLine],
    backends: &[Backend],
    mode: Mode,
    x: fn(&ResultLine) -> f64,
    y: fn(&ResultLine) -> Option<f64>,
    suffix: &str,
    dashed: bool,
) -> Vec<Line> {
    backends
        .iter()
        .map(|&b| {
            let mut pts: Vec<(f64, f64)> = results
                .iter()
                .filter(|l| l.backend == b && l.mode == mode)
                .filter_map(|l| y(l).filter(|v| *v > 0.0).map(|v| (x(l), v)))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            Line {
                label: format!("{}{suffix}", b.name()),
                color: backend_color(b.name()),
                dashed,
                pts,
            }
        })
        .filter(|l| !l.pts.is_empty())
        .collect()
}

fn bounds(s: &[Line]) -> ((f64, f64), (f64, f64)) {
    let pts = s.iter().flat_map(|l| l.pts.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        return ((1.0, 10.0), (1.0, 10.0));
    }
    // Headroom above the data for the legend in the upper left.
    ((x0 * 0.8, x1 * 1.25), (y0 / 2.0, y1 * 8.0))
}

/// Mesh, one line with markers per backend, and the legend, on `$chart`;
/// `$x` maps a data x to the chart's x. A macro because the two charts'
/// coordinate types differ.
macro_rules! lines_and_legend {
    ($chart:expr, $s:expr, $x:expr, $x_desc:expr, $y_desc:expr, $x_fmt:expr, $x_labels:expr) => {{
        $chart
            .configure_mesh()
            .x_desc($x_desc)
            .y_desc($y_desc)
            .x_labels($x_labels)
            .x_label_formatter($x_fmt)
            .y_label_formatter(&si)
            .draw()
            .map_err(err)?;
        for line in $s.iter() {
            let c = line.color;
            let pts: Vec<(f64, f64)> = line.pts.iter().map(|&(x, y)| ($x(x), y)).collect();
            let drawn = if line.dashed {
                $chart.draw_series(DashedLineSeries::new(
                    pts.iter().copied(),
                    6,
                    4,
                    c.stroke_width(2),
                ))
            } else {
                $chart.draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))
            };
            let dashed = line.dashed;
            drawn
                .map_err(err)?
                .label(line.label.as_str())
                .legend(move |(x, y)| {
                    if dashed {
                        DashedPathElement::new(vec![(x, y), (x + 18, y)], 5, 3, c.stroke_width(2))
                            .into_dyn()
                    } else {
                        PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)).into_dyn()
                    }
                });
            $chart
                .draw_series(pts.iter().map(|&p| Circle::new(p, 3, c.filled())))
                .map_err(err)?;
        }
        $chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(err)?;
    }};
}

/// How the x axis is drawn.
#[derive(Clone, Copy)]
enum XAxis {
    /// Logarithmic, decimal ticks.
    Log10,
    /// One tick per power of two (x = 1, 2, 4, ...): drawn as log2(x) on a
    /// linear axis.
    Pow2,
}

fn log_lines(
    s: &[Line],
    caption: &str,
    x_desc: &str,
    y_desc: &str,
    x_axis: XAxis,
) -> Result<String, String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (W, H)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let ((x0, x1), (y0, y1)) = bounds(s);
        let mut builder = ChartBuilder::on(&root);
        builder
            .caption(caption, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(70);
        match x_axis {
            XAxis::Log10 => {
                let mut chart = builder
                    .build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())
                    .map_err(err)?;
                lines_and_legend!(chart, s, |x| x, x_desc, y_desc, &si, 10);
            }
            XAxis::Pow2 => {
                let (l0, l1) = (x0.log2().floor(), x1.log2().ceil());
                let mut chart = builder
                    .build_cartesian_2d(l0..l1, (y0..y1).log_scale())
                    .map_err(err)?;
                let ticks = (l1 - l0) as usize + 1;
                lines_and_legend!(
                    chart,
                    s,
                    |x: f64| x.log2(),
                    x_desc,
                    y_desc,
                    &pow2_label,
                    ticks
                );
            }
        }
        root.present().map_err(err)?;
    }
    Ok(svg)
}

/// A tick at log2(x) = `v`: x when `v` is a whole number, else nothing.
fn pow2_label(v: &f64) -> String {
    let r = v.round();
    if (v - r).abs() < 1e-6 && (0.0..63.0).contains(&r) {
        format!("{}", 1u64 << r as u32)
    } else {
        String::new()
    }
}

/// 1.5M, 120k, 12, 0.25: axis labels without a tail of zeros.
fn si(v: &f64) -> String {
    let v = *v;
    let trim = |s: String| {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_owned()
        } else {
            s
        }
    };
    if v >= 1e6 {
        format!("{}M", trim(format!("{:.2}", v / 1e6)))
    } else if v >= 1e3 {
        format!("{}k", trim(format!("{:.2}", v / 1e3)))
    } else {
        trim(format!("{v:.3}"))
    }
}

/// Round-trip p50 (solid) and p99 (dashed) against payload size, in each
/// backend's colour.
pub fn latency(lines: &[ResultLine], backends: &[Backend]) -> Result<String, String> {
    let size = |l: &ResultLine| l.size as f64;
    let mut s = lines_of(
        lines,
        backends,
        Mode::Lat,
        size,
        |l| l.p50_us,
        " p50",
        false,
    );
    s.extend(lines_of(
        lines,
        backends,
        Mode::Lat,
        size,
        |l| l.p99_us,
        " p99",
        true,
    ));
    log_lines(
        &s,
        "Latency: round trip p50 (solid) and p99 (dashed) against size",
        "payload bytes",
        "round trip (µs)",
        XAxis::Log10,
    )
}

/// Messages per second against requests in flight, one line per backend.
pub fn rate(lines: &[ResultLine], backends: &[Backend]) -> Result<String, String> {
    let s = lines_of(
        lines,
        backends,
        Mode::Rate,
        |l| l.inflight as f64,
        |l| l.msgs_per_s,
        "",
        false,
    );
    log_lines(
        &s,
        "Message rate against requests in flight",
        "requests in flight",
        "messages/s",
        XAxis::Pow2,
    )
}

/// Bandwidth (payload Gb/s) against message size, one line per backend.
pub fn bandwidth(lines: &[ResultLine], backends: &[Backend]) -> Result<String, String> {
    let s = lines_of(
        lines,
        backends,
        Mode::Bw,
        |l| l.size as f64,
        |l| l.gbps,
        "",
        false,
    );
    log_lines(
        &s,
        "Bandwidth against message size",
        "payload bytes per message",
        "payload Gb/s",
        XAxis::Log10,
    )
}

/// A bar: a value with an optional spread, in its backend's colour (a
/// lighter shade when `light`).
#[derive(Debug, Clone, PartialEq)]
pub struct Bar {
    /// Label under the bar.
    pub label: String,
    /// Backend name (picks the colour).
    pub backend: String,
    /// Drawn in the lighter shade (unfused).
    pub light: bool,
    /// Height.
    pub value: f64,
    /// Lowest and highest of the runs behind `value`, drawn as an error
    /// bar.
    pub spread: Option<(f64, f64)>,
}

/// Bars of `bars`, captioned, with their values written above them.
fn bar_chart(bars: &[Bar], caption: &str, y_desc: &str) -> Result<String, String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (W, H)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let top = bars
            .iter()
            .map(|b| b.spread.map_or(b.value, |s| s.1.max(b.value)))
            .fold(0.0f64, f64::max)
            .max(1.0)
            * 1.15;
        let n = bars.len().max(1);
        let mut chart = ChartBuilder::on(&root)
            .caption(caption, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(80)
            .build_cartesian_2d(0f64..n as f64, 0f64..top)
            .map_err(err)?;
        let names: Vec<String> = bars.iter().map(|b| b.label.clone()).collect();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n * 2 + 1)
            .x_label_formatter(&|x| {
                let i = x.floor() as usize;
                if (x - i as f64 - 0.5).abs() < 1e-6 {
                    names.get(i).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .y_desc(y_desc)
            .y_label_formatter(&si)
            .draw()
            .map_err(err)?;
        chart
            .draw_series(bars.iter().enumerate().map(|(i, b)| {
                let x = i as f64;
                let c = backend_color(&b.backend);
                let c = if b.light { light(c) } else { c };
                Rectangle::new([(x + 0.15, 0.0), (x + 0.85, b.value)], c.filled())
            }))
            .map_err(err)?;
        chart
            .draw_series(bars.iter().enumerate().filter_map(|(i, b)| {
                b.spread.map(|(lo, hi)| {
                    ErrorBar::new_vertical(
                        i as f64 + 0.5,
                        lo,
                        b.value,
                        hi,
                        BLACK.stroke_width(1),
                        10,
                    )
                })
            }))
            .map_err(err)?;
        chart
            .draw_series(bars.iter().enumerate().map(|(i, b)| {
                let above = b.spread.map_or(b.value, |s| s.1.max(b.value));
                Text::new(
                    si(&b.value),
                    (i as f64 + 0.3, above + top * 0.06),
                    ("sans-serif", 14),
                )
            }))
            .map_err(err)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}

/// Fused and unfused steps/s per backend: the backend's colour for fused,
/// its lighter shade for unfused.
pub fn fusion(lines: &[ResultLine], backends: &[Backend]) -> Result<String, String> {
    let mut bars = Vec::new();
    for &b in backends {
        let Some(l) = lines
            .iter()
            .find(|l| l.backend == b && l.mode == Mode::Fuse)
        else {
            continue;
        };
        for (fused, v) in [(true, l.fused_steps_per_s), (false, l.unfused_steps_per_s)] {
            if let Some(v) = v {
                bars.push(Bar {
                    label: format!("{} {}", b.name(), if fused { "fused" } else { "unfused" }),
                    backend: b.name().to_owned(),
                    light: !fused,
                    value: v,
                    spread: None,
                });
            }
        }
    }
    let caption = match lines.iter().find(|l| l.mode == Mode::Fuse) {
        Some(l) => format!(
            "Fusion: steps/s, {} tensors of {} B per step",
            l.tensors.unwrap_or(0),
            l.size
        ),
        None => "Fusion: steps/s".to_owned(),
    };
    bar_chart(&bars, &caption, "steps/s")
}

/// Train samples/s, one bar per (backend, fusion) case, median with the
/// spread of its runs.
pub fn train(bars: &[Bar]) -> Result<String, String> {
    bar_chart(
        bars,
        "Train (lr, dim 64, batch 512): samples/s, median and range",
        "samples/s",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axis_labels() {
        assert_eq!(si(&1_500_000.0), "1.5M");
        assert_eq!(si(&100_000.0), "100k");
        assert_eq!(si(&12.0), "12");
        assert_eq!(si(&0.25), "0.25");
        assert_eq!(pow2_label(&5.0), "32");
        assert_eq!(pow2_label(&0.0), "1");
        assert_eq!(pow2_label(&4.5), "");
    }

    fn bar(label: &str, backend: &str, light: bool, value: f64) -> Bar {
        Bar {
            label: label.into(),
            backend: backend.into(),
            light,
            value,
            spread: Some((value * 0.9, value * 1.1)),
        }
    }

    #[test]
    fn train_plot_is_svg_with_a_bar_per_case() {
        let svg = train(&[
            bar("tcp fused", "tcp", false, 5000.0),
            bar("grpc unfused", "grpc", true, 500.0),
        ])
        .unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("tcp fused") && svg.contains("grpc unfused"));
        assert!(svg.matches("<rect").count() >= 3, "background + 2 bars");
    }

    /// `#rrggbb` of a colour, as the SVG backend writes it.
    fn hex(c: RGBColor) -> String {
        format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2)
    }

    #[test]
    fn a_backend_keeps_its_colour_in_every_chart() {
        let names = ["raw", "tcp", "uring", "grpc", "dpdk", "verbs", "inproc"];
        let mut all: Vec<RGBColor> = names.iter().map(|n| backend_color(n)).collect();
        all.sort_by_key(|c| (c.0, c.1, c.2));
        all.dedup();
        assert_eq!(all.len(), names.len(), "distinct colours");
        assert_eq!(backend_color("newone"), backend_color("newone"));
        // uring alone, or after two others: the same colour in both.
        let line = |b: Backend| ResultLine {
            backend: b,
            ..serde_json::from_value(serde_json::json!({
                "backend": "tcp", "mode": "lat", "size": 64, "inflight": 1,
                "iters": 1, "p50_us": 10.0, "p99_us": 20.0, "p999_us": null,
                "min_us": null, "max_us": null, "msgs_per_s": 1.0, "gbps": 1.0,
                "polling": true, "client_core": null, "server_core": null,
                "fused_steps_per_s": null, "unfused_steps_per_s": null,
                "tensors": null, "repeat": 1
            }))
            .unwrap()
        };
        let one = latency(&[line(Backend::Tcp)], &[Backend::Tcp]).unwrap();
        let two = latency(
            &[line(Backend::Raw), line(Backend::Tcp)],
            &[Backend::Raw, Backend::Tcp],
        )
        .unwrap();
        let tcp = hex(backend_color("tcp"));
        assert!(one.contains(&tcp) && two.contains(&tcp), "{one}");
        assert!(two.contains(&hex(backend_color("raw"))));
        // p99 is dashed: more path pieces than the solid p50 alone.
        assert!(one.contains("tcp p99") && one.contains("tcp p50"), "{one}");
    }

    #[test]
    fn light_is_lighter() {
        let c = light(RGBColor(0, 100, 200));
        assert!(c.0 > 0 && c.1 > 100 && c.2 > 200 && c.2 < 255);
    }
}
