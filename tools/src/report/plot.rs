//! The report's SVG plots (plotters' SVG backend: text is written as SVG
//! `<text>` for the viewer to render, so no font files are needed here).

use plotters::prelude::*;

use crate::backend::Backend;
use crate::bench::{Mode, ResultLine};

const W: u32 = 760;
const H: u32 = 480;

fn color(i: usize) -> RGBColor {
    const C: [RGBColor; 6] = [
        RGBColor(90, 90, 90),
        RGBColor(31, 119, 180),
        RGBColor(214, 39, 40),
        RGBColor(44, 160, 44),
        RGBColor(148, 103, 189),
        RGBColor(255, 127, 14),
    ];
    C[i % C.len()]
}

fn err(e: impl std::fmt::Display) -> String {
    format!("drawing a plot: {e}")
}

/// Series of (x, y) per backend, y > 0, for a log-log line plot.
type Series = Vec<(Backend, Vec<(f64, f64)>)>;

fn series(
    lines: &[ResultLine],
    backends: &[Backend],
    mode: Mode,
    x: fn(&ResultLine) -> f64,
    y: fn(&ResultLine) -> Option<f64>,
) -> Series {
    backends
        .iter()
        .map(|&b| {
            let mut pts: Vec<(f64, f64)> = lines
                .iter()
                .filter(|l| l.backend == b && l.mode == mode)
                .filter_map(|l| y(l).filter(|v| *v > 0.0).map(|v| (x(l), v)))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            (b, pts)
        })
        .filter(|(_, p)| !p.is_empty())
        .collect()
}

fn bounds(s: &Series) -> ((f64, f64), (f64, f64)) {
    let pts = s.iter().flat_map(|(_, p)| p.iter());
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
        for (i, (b, pts)) in $s.iter().enumerate() {
            let c = color(i);
            let pts: Vec<(f64, f64)> = pts.iter().map(|&(x, y)| ($x(x), y)).collect();
            $chart
                .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))
                .map_err(err)?
                .label(b.name())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2))
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
    s: &Series,
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

/// Round-trip p50 against payload size, one line per backend.
pub fn latency(lines: &[ResultLine], backends: &[Backend]) -> Result<String, String> {
    let s = series(lines, backends, Mode::Lat, |l| l.size as f64, |l| l.p50_us);
    log_lines(
        &s,
        "Latency: p50 round trip against payload size",
        "payload bytes",
        "p50 round trip (µs)",
        XAxis::Log10,
    )
}

/// Messages per second against requests in flight, one line per backend.
pub fn rate(lines: &[ResultLine], backends: &[Backend]) -> Result<String, String> {
    let s = series(
        lines,
        backends,
        Mode::Rate,
        |l| l.inflight as f64,
        |l| l.msgs_per_s,
    );
    log_lines(
        &s,
        "Message rate against requests in flight",
        "requests in flight",
        "messages/s",
        XAxis::Pow2,
    )
}

/// Train samples/s, one bar per (backend, fusion) case.
pub fn train(bars: &[(String, f64)]) -> Result<String, String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (W, H)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let top = bars.iter().map(|b| b.1).fold(0.0f64, f64::max).max(1.0) * 1.15;
        let n = bars.len().max(1);
        let mut chart = ChartBuilder::on(&root)
            .caption(
                "Train (lr, dim 64, batch 512): samples/s",
                ("sans-serif", 20),
            )
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(80)
            .build_cartesian_2d(0f64..n as f64, 0f64..top)
            .map_err(err)?;
        let names: Vec<String> = bars.iter().map(|b| b.0.clone()).collect();
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
            .y_desc("samples/s")
            .y_label_formatter(&si)
            .draw()
            .map_err(err)?;
        chart
            .draw_series(bars.iter().enumerate().map(|(i, (_, v))| {
                let x = i as f64;
                Rectangle::new([(x + 0.15, 0.0), (x + 0.85, *v)], color(i + 1).filled())
            }))
            .map_err(err)?;
        chart
            .draw_series(bars.iter().enumerate().map(|(i, (_, v))| {
                Text::new(
                    format!("{v:.0}"),
                    (i as f64 + 0.3, v + top * 0.02),
                    ("sans-serif", 14),
                )
            }))
            .map_err(err)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
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

    #[test]
    fn train_plot_is_svg_with_a_bar_per_case() {
        let svg = train(&[("tcp fused".into(), 5000.0), ("grpc unfused".into(), 500.0)]).unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("tcp fused") && svg.contains("grpc unfused"));
        assert!(svg.matches("<rect").count() >= 3, "background + 2 bars");
    }
}
