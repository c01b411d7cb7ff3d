//! Charts of the replay report, drawn by the `plotters` crate as SVG text (inlined in the HTML report, or
//! written next to a sweep's JSON).
//!
//! Invariants:
//! - Every chart has a title, axis titles with units, a light grid at its ticks and a legend naming each
//!   series, drawn right of the plot so it never hides data; tick values are plotters' round steps (1, 2 or 5 × 10^k) printed without float noise.
//! - Font sizes are given in points: plotters' SVG backend writes them as 0.8 of that in pixels.
//! - Series keep their order and colour across every chart of a report: series `i` has [`PALETTE`]`[i % 10]`;
//!   the runs of one series in a per-run chart differ by dash pattern.
//! - Axes start at zero unless the caller gives a range, and always leave room above the largest value; an
//!   empty or non-finite input still draws a valid (empty) chart instead of failing.

use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::error::{ReplayError, Result};
use crate::pareto::{frontier, spline, ParetoPoint};

/// Tableau 10: distinct colours that stay apart for colour-blind readers.
pub const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// The colour of series `i`, as CSS (for tables that match the charts).
pub fn css_color(i: usize) -> String {
    let RGBColor(r, g, b) = PALETTE[i % PALETTE.len()];
    format!("#{r:02x}{g:02x}{b:02x}")
}

const FONT: &str = "sans-serif";
const GRID: RGBColor = RGBColor(226, 226, 226);

/// What every chart states.
#[derive(Clone, Debug)]
pub struct Chart {
    pub title: String,
    /// Axis titles, units included.
    pub x_label: String,
    pub y_label: String,
    /// Pixels.
    pub width: u32,
    pub height: u32,
}

/// The runs of one label, as Pareto points.
#[derive(Clone, Debug)]
pub struct ParetoSeries {
    pub label: String,
    pub points: Vec<ParetoPoint>,
}

/// One line of a line chart.
#[derive(Clone, Debug)]
pub struct Line {
    pub label: String,
    /// Index into [`PALETTE`] (the run's series).
    pub color: usize,
    pub points: Vec<(f64, f64)>,
    /// Mark each point (for sparse data such as draft positions).
    pub markers: bool,
    pub dash: Dash,
}

/// How a line is stroked: tells apart the runs of one series.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dash {
    Solid,
    Dashed,
    Dotted,
}

impl Dash {
    /// The pattern of the `i`-th run of a series.
    pub fn nth(i: usize) -> Dash {
        [Dash::Solid, Dash::Dashed, Dash::Dotted][i % 3]
    }
}

/// One legend row.
struct Entry {
    label: String,
    color: RGBColor,
    dot: bool,
    dash: Dash,
}

/// The axes of a line chart.
#[derive(Clone, Copy, Debug)]
pub struct Axes {
    pub x: (f64, f64),
    pub y: (f64, f64),
    /// Label only whole numbers on x (draft positions).
    pub integer_x: bool,
}

fn plot_error(chart: &Chart, e: impl std::fmt::Display) -> ReplayError {
    ReplayError::Plot { chart: chart.title.clone(), reason: e.to_string() }
}

/// A tick value: whole numbers with thousands separators, others with at most 3 significant decimals.
pub fn tick(v: f64) -> String {
    if !v.is_finite() {
        return String::new();
    }
    let rounded = (v * 1000.0).round() / 1000.0;
    if rounded.fract() == 0.0 {
        let digits = format!("{:.0}", rounded.abs());
        let mut grouped = String::new();
        for (i, c) in digits.chars().enumerate() {
            if i > 0 && (digits.len() - i) % 3 == 0 {
                grouped.push(',');
            }
            grouped.push(c);
        }
        return if rounded < 0.0 { format!("-{grouped}") } else { grouped };
    }
    let text = format!("{rounded:.3}");
    text.trim_end_matches('0').trim_end_matches('.').to_owned()
}

/// The upper end of an axis whose largest value is `max`: a little above it, never zero or non-finite.
pub fn headroom(max: f64) -> f64 {
    if max.is_finite() && max > 0.0 {
        max * 1.12
    } else {
        1.0
    }
}

fn finite(points: &[(f64, f64)]) -> impl Iterator<Item = (f64, f64)> + '_ {
    points.iter().copied().filter(|(x, y)| x.is_finite() && y.is_finite())
}

/// Draws into an SVG string: the plot on the left, the legend of `entries` in a column on the right.
fn svg(
    chart: &Chart,
    entries: &[Entry],
    draw: impl FnOnce(&DrawingArea<SVGBackend, Shift>) -> Result<()>,
) -> Result<String> {
    let longest = entries.iter().map(|e| e.label.chars().count()).max().unwrap_or(0) as u32;
    let legend_width = (longest * 9 + 64).clamp(150, 340).min(chart.width / 2);
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (chart.width, chart.height)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| plot_error(chart, e))?;
        let (plot, side) = root.split_horizontally(chart.width - legend_width);
        draw(&plot)?;
        side_legend(&side, entries).map_err(|e| plot_error(chart, e))?;
        root.present().map_err(|e| plot_error(chart, e))?;
    }
    Ok(out)
}

/// A path in `dash`'s pattern.
fn stroke<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    points: Vec<(i32, i32)>,
    style: ShapeStyle,
    dash: Dash,
) -> std::result::Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    match dash {
        Dash::Solid => area.draw(&PathElement::new(points, style)),
        Dash::Dashed => area.draw(&DashedPathElement::new(points, 9, 5, style)),
        Dash::Dotted => area.draw(&DashedPathElement::new(points, 2, 4, style)),
    }
}

fn side_legend(area: &DrawingArea<SVGBackend, Shift>, entries: &[Entry]) -> DrawResult {
    for (i, e) in entries.iter().enumerate() {
        let y = 72 + 28 * i as i32;
        stroke(area, vec![(6, y), (36, y)], e.color.stroke_width(3), e.dash)?;
        if e.dot {
            area.draw(&Circle::new((21, y), 5, e.color.filled()))?;
        }
        let font = TextStyle::from((FONT, 17).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
        area.draw(&Text::new(e.label.clone(), (44, y), font))?;
    }
    Ok(())
}

/// Throughput against P90 interactivity: every run a point labelled with its concurrency (filled on its
/// series' frontier, hollow when dominated), each series' frontier a monotone curve, one colour per series.
pub fn pareto(chart: &Chart, series: &[ParetoSeries]) -> Result<String> {
    let all: Vec<(f64, f64)> = series.iter().flat_map(|s| s.points.iter().map(|p| (p.x, p.y))).collect();
    let max_x = headroom(finite(&all).map(|p| p.0).fold(0.0, f64::max));
    let max_y = headroom(finite(&all).map(|p| p.1).fold(0.0, f64::max));
    let entries: Vec<Entry> = series
        .iter()
        .enumerate()
        .map(|(i, s)| Entry { label: s.label.clone(), color: PALETTE[i % PALETTE.len()], dot: true, dash: Dash::Solid })
        .collect();
    svg(chart, &entries, |area| {
        let err = |e| plot_error(chart, e);
        let mut ctx = axes_on(area, chart, (0.0..max_x, 0.0..max_y)).map_err(err)?;
        mesh(&mut ctx, chart, false).map_err(err)?;
        for (i, s) in series.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            let front = frontier(&s.points);
            let curve = spline(&front, 24);
            if curve.len() >= 2 {
                ctx.draw_series(std::iter::once(PathElement::new(curve, color.stroke_width(2)))).map_err(err)?;
            }
            let marks = s.points.iter().filter(|p| p.x.is_finite() && p.y.is_finite()).map(|p| {
                let on_front = front.iter().any(|f| f.concurrency == p.concurrency);
                let style = if on_front { color.filled() } else { color.stroke_width(2) };
                EmptyElement::at((p.x, p.y))
                    + Circle::new((0, 0), 5, style)
                    + Text::new(format!("c={}", p.concurrency), (7, -16), (FONT, 16).into_font().color(&color))
            });
            ctx.draw_series(marks).map_err(err)?;
        }
        Ok(())
    })
}

/// Lines (CDFs, acceptance by position), one colour per run's series.
pub fn lines(chart: &Chart, lines: &[Line], axes: Axes) -> Result<String> {
    let entries: Vec<Entry> = lines
        .iter()
        .map(|l| Entry {
            label: l.label.clone(),
            color: PALETTE[l.color % PALETTE.len()],
            dot: l.markers,
            dash: l.dash,
        })
        .collect();
    svg(chart, &entries, |area| {
        let err = |e| plot_error(chart, e);
        let mut ctx = axes_on(area, chart, (axes.x.0..axes.x.1, axes.y.0..axes.y.1)).map_err(err)?;
        mesh(&mut ctx, chart, axes.integer_x).map_err(err)?;
        for line in lines {
            let color = PALETTE[line.color % PALETTE.len()];
            let points: Vec<(f64, f64)> = finite(&line.points).collect();
            let style = color.stroke_width(2);
            match line.dash {
                Dash::Solid => ctx.draw_series(std::iter::once(PathElement::new(points.clone(), style))),
                Dash::Dashed => ctx.draw_series(std::iter::once(DashedPathElement::new(points.clone(), 9, 5, style))),
                Dash::Dotted => ctx.draw_series(std::iter::once(DashedPathElement::new(points.clone(), 2, 4, style))),
            }
            .map_err(err)?;
            if line.markers {
                ctx.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled()))).map_err(err)?;
            }
        }
        Ok(())
    })
}

type Ctx<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;
type DrawResult = std::result::Result<(), DrawingAreaErrorKind<std::io::Error>>;

/// The chart's caption and linear axes over `ranges` (x, y), with room for the tick labels, on `area`.
fn axes_on<'a, 'b>(
    area: &'a DrawingArea<SVGBackend<'b>, Shift>,
    chart: &Chart,
    ranges: (std::ops::Range<f64>, std::ops::Range<f64>),
) -> std::result::Result<Ctx<'a, 'b>, DrawingAreaErrorKind<std::io::Error>> {
    ChartBuilder::on(area)
        .caption(&chart.title, (FONT, 24))
        .margin(18)
        .margin_top(36)
        .x_label_area_size(52)
        .y_label_area_size(78)
        .build_cartesian_2d(ranges.0, ranges.1)
}

fn mesh<'a, 'b: 'a>(ctx: &mut Ctx<'a, 'b>, chart: &Chart, integer_x: bool) -> DrawResult {
    // At most one tick per whole number on an integer axis, so plotters' round step is 1 (or more), never 0.2.
    let x_range = ctx.x_range();
    let x_ticks = if integer_x { ((x_range.end - x_range.start).floor() as usize).max(1) } else { 8 };
    let x_format = move |v: &f64| if integer_x && v.fract() != 0.0 { String::new() } else { tick(*v) };
    ctx.configure_mesh()
        .x_desc(chart.x_label.as_str())
        .y_desc(chart.y_label.as_str())
        .x_labels(x_ticks)
        .y_labels(8)
        .x_label_formatter(&x_format)
        .y_label_formatter(&|v| tick(*v))
        .bold_line_style(GRID)
        .light_line_style(TRANSPARENT)
        .axis_style(RGBColor(90, 90, 90))
        .label_style((FONT, 16))
        .axis_desc_style((FONT, 18))
        .draw()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The texts of an SVG's `<text>` elements.
    fn texts(svg: &str) -> Vec<String> {
        svg.split("<text")
            .skip(1)
            .filter_map(|t| Some(t.split_once('>')?.1.split_once("</text>")?.0.trim().to_owned()))
            .collect()
    }

    fn chart(title: &str) -> Chart {
        Chart { title: title.into(), x_label: "x (u)".into(), y_label: "y (v)".into(), width: 640, height: 400 }
    }

    #[test]
    fn ticks_are_round_and_free_of_float_noise() {
        assert_eq!(tick(0.30000000000000004), "0.3");
        assert_eq!(tick(12000.0), "12,000");
        assert_eq!(tick(-1500.0), "-1,500");
        assert_eq!(tick(2.5), "2.5");
        assert_eq!(tick(0.0125), "0.013");
        assert_eq!(tick(7.0), "7");
        assert_eq!(tick(f64::NAN), "");
    }

    fn p(c: usize, x: f64, y: f64) -> ParetoPoint {
        ParetoPoint { concurrency: c, x, y, per_gpu: false, p90_ttft_s: 0.0 }
    }

    #[test]
    fn the_pareto_chart_names_its_series_axes_and_points() {
        let series = [
            ParetoSeries { label: "spec off".into(), points: vec![p(1, 40.0, 100.0), p(4, 30.0, 300.0)] },
            ParetoSeries { label: "dspark <AL 3>".into(), points: vec![p(1, 90.0, 200.0), p(4, 60.0, 600.0)] },
        ];
        let svg = pareto(&chart("Pareto & co"), &series).unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "{svg:.200}");
        let texts = texts(&svg);
        for text in ["Pareto &amp; co", "x (u)", "y (v)", "spec off", "dspark &lt;AL 3&gt;", "c=4", "600", "80"] {
            assert!(texts.iter().any(|t| t == text), "missing {text:?} in {texts:?}");
        }
        // Legend colours are the palette's, in series order.
        assert!(svg.contains("#1F77B4"), "first series colour missing");
        assert!(svg.contains("#FF7F0E"), "second series colour missing");
        // The legend stands right of every data point, so it never hides one.
        let attr = |tag: &str, name: &str| -> Vec<f64> {
            svg.split(tag)
                .skip(1)
                .filter_map(|t| t.split(&format!(" {name}=\"")).nth(1)?.split('"').next()?.parse().ok())
                .collect()
        };
        let rightmost_point = attr("<circle", "cx").into_iter().fold(0.0, f64::max);
        let legend_x = svg
            .split("<text")
            .find(|t| t.contains(">\nspec off\n<"))
            .and_then(|t| t.split(" x=\"").nth(1)?.split('"').next()?.parse::<f64>().ok())
            .expect("the legend names the first series");
        assert!(legend_x > rightmost_point + 20.0, "legend at x={legend_x}, a point at x={rightmost_point}");
    }

    #[test]
    fn empty_or_non_finite_data_still_draws_a_chart() {
        let svg = pareto(&chart("empty"), &[ParetoSeries { label: "none".into(), points: vec![p(1, f64::NAN, 1.0)] }])
            .unwrap();
        assert!(svg.contains("empty") && svg.contains("none"));
        let axes = Axes { x: (0.5, 3.5), y: (0.0, 100.0), integer_x: true };
        let line = Line {
            label: "run".into(),
            color: 0,
            points: vec![(1.0, 90.0), (2.0, 50.0), (3.0, 10.0)],
            markers: true,
            dash: Dash::Dashed,
        };
        let texts = texts(&lines(&chart("positions"), &[line], axes).unwrap());
        assert!(texts.iter().any(|t| t == "2"), "{texts:?}");
        assert!(!texts.iter().any(|t| t.contains('.')), "an integer axis labels a fraction: {texts:?}");
    }
}
