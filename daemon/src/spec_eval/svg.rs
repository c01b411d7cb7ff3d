//! The reliability diagram of `sparkd spec-eval --svg`: predicted confidence against observed acceptance, one point
//! per non-empty confidence bin and one labelled point per reached draft position, over the diagonal of perfect
//! calibration. Written by hand (no plotting crate): a self-contained SVG 1.1 document.
//!
//! Invariants:
//! - Exactly one `class="bin"` circle per bin with samples (its area proportional to its count) and one
//!   `class="position"` square per position that was reached, each labelled with its 1-based position; empty bins
//!   and positions draw nothing.
//! - Every point lies inside the unit square of the plot (rates and confidences are in [0, 1]); text from outside
//!   (the title) is escaped, so the document is well-formed XML whatever it says.

use std::fmt::Write;

use super::stats::Calibration;

/// Left margin (tick labels and the y-axis title).
const LEFT: f64 = 70.0;
/// Top margin (the title lines).
const TOP: f64 = 60.0;
/// Side of the square plot area.
const SIDE: f64 = 440.0;
/// Right margin (the legend).
const RIGHT: f64 = 190.0;
/// Bottom margin (tick labels and the x-axis title).
const BOTTOM: f64 = 60.0;
/// Radius of the smallest and largest bin circle.
const MIN_RADIUS: f64 = 3.0;
const MAX_RADIUS: f64 = 12.0;

fn x(confidence: f64) -> f64 {
    LEFT + confidence.clamp(0.0, 1.0) * SIDE
}

fn y(rate: f64) -> f64 {
    TOP + (1.0 - rate.clamp(0.0, 1.0)) * SIDE
}

/// `text` with XML's special characters escaped.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for ch in text.chars() {
        match ch {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c => out.push(c),
        }
    }
    out
}

/// The reliability diagram of `calibration` under the heading `title`.
pub fn reliability_svg(calibration: &Calibration, title: &str) -> String {
    let (width, height) = (LEFT + SIDE + RIGHT, TOP + SIDE + BOTTOM);
    let mut s = String::new();
    // Writing into a String cannot fail.
    let _ = write!(
        s,
        r##"<?xml version="1.0" encoding="UTF-8"?>
<svg xmlns="http://www.w3.org/2000/svg" version="1.1" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">
<rect x="0" y="0" width="{width}" height="{height}" fill="white"/>
<text x="{LEFT}" y="22" font-size="15">{}</text>
<text x="{LEFT}" y="42" fill="#444">{}</text>
"##,
        escape(title),
        escape(&summary(calibration)),
    );
    axes(&mut s);
    let _ = writeln!(
        s,
        r##"<line class="diagonal" x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#888" stroke-dasharray="6,4"/>"##,
        x(0.0),
        y(0.0),
        x(1.0),
        y(1.0)
    );
    let most = calibration.bins.iter().map(|b| b.count).max().unwrap_or(0).max(1);
    for bin in &calibration.bins {
        let (Some(c), Some(r)) = (bin.mean_confidence, bin.observed_rate) else { continue };
        let radius = MIN_RADIUS + (MAX_RADIUS - MIN_RADIUS) * (bin.count as f64 / most as f64).sqrt();
        let _ = writeln!(
            s,
            r##"<circle class="bin" cx="{:.1}" cy="{:.1}" r="{radius:.1}" fill="#1f77b4" fill-opacity="0.6" stroke="#1f77b4"><title>confidence [{:.1}, {:.1}{}: {} samples, mean confidence {c:.3}, observed {r:.3}</title></circle>"##,
            x(c),
            y(r),
            bin.lower,
            bin.upper,
            if bin.upper >= 1.0 { "]" } else { ")" },
            bin.count,
        );
    }
    for p in &calibration.positions {
        let (Some(c), Some(r)) = (p.mean_confidence, p.observed_rate) else { continue };
        let _ = writeln!(
            s,
            r##"<g class="position"><rect x="{:.1}" y="{:.1}" width="7" height="7" fill="#d62728"><title>position {}: reached {}, accepted {}, mean confidence {c:.3}, observed {r:.3}</title></rect><text x="{:.1}" y="{:.1}" fill="#d62728" font-size="11">{}</text></g>"##,
            x(c) - 3.5,
            y(r) - 3.5,
            p.position,
            p.reached,
            p.accepted,
            x(c) + 6.0,
            y(r) - 5.0,
            p.position,
        );
    }
    legend(&mut s);
    s.push_str("</svg>\n");
    s
}

/// One line under the title: the numbers the diagram shows.
fn summary(c: &Calibration) -> String {
    let or_dash = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.3}"));
    format!(
        "{} verify rounds, {} reached positions; AL {} (predicted {}), ECE {}",
        c.rounds,
        c.samples,
        or_dash(c.acceptance_length),
        or_dash(c.predicted_acceptance_length),
        or_dash(c.ece)
    )
}

/// The frame, the grid with its tick labels every 0.2, and the axis titles.
fn axes(s: &mut String) {
    let _ = writeln!(s, r##"<rect x="{LEFT}" y="{TOP}" width="{SIDE}" height="{SIDE}" fill="none" stroke="black"/>"##);
    for i in 0..=5 {
        let v = i as f64 / 5.0;
        let _ = writeln!(
            s,
            r##"<line x1="{:.1}" y1="{TOP}" x2="{:.1}" y2="{:.1}" stroke="#ddd"/><line x1="{LEFT}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#ddd"/>"##,
            x(v),
            x(v),
            TOP + SIDE,
            y(v),
            LEFT + SIDE,
            y(v)
        );
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="middle">{v:.1}</text><text x="{:.1}" y="{:.1}" text-anchor="end">{v:.1}</text>"##,
            x(v),
            TOP + SIDE + 18.0,
            LEFT - 8.0,
            y(v) + 4.0
        );
    }
    let _ = writeln!(
        s,
        r##"<text x="{:.1}" y="{:.1}" text-anchor="middle">predicted confidence (conditional, per draft position)</text>"##,
        LEFT + SIDE / 2.0,
        TOP + SIDE + 42.0
    );
    let (cx, cy) = (LEFT - 45.0, TOP + SIDE / 2.0);
    let _ = writeln!(
        s,
        r##"<text x="{cx:.1}" y="{cy:.1}" text-anchor="middle" transform="rotate(-90 {cx:.1} {cy:.1})">observed acceptance rate</text>"##
    );
}

/// What the marks mean, right of the plot.
fn legend(s: &mut String) {
    let (lx, ly) = (LEFT + SIDE + 20.0, TOP + 20.0);
    let _ = writeln!(
        s,
        r##"<g class="legend"><circle cx="{:.1}" cy="{ly:.1}" r="6" fill="#1f77b4" fill-opacity="0.6" stroke="#1f77b4"/><text x="{:.1}" y="{:.1}">confidence bin</text><text x="{:.1}" y="{:.1}" fill="#444">(area: samples)</text><rect x="{:.1}" y="{:.1}" width="7" height="7" fill="#d62728"/><text x="{:.1}" y="{:.1}">draft position k</text><line x1="{lx:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#888" stroke-dasharray="6,4"/><text x="{:.1}" y="{:.1}">perfect calibration</text></g>"##,
        lx + 6.0,
        lx + 20.0,
        ly + 4.0,
        lx + 20.0,
        ly + 20.0,
        lx + 2.5,
        ly + 36.5,
        lx + 20.0,
        ly + 44.0,
        ly + 70.0,
        lx + 14.0,
        ly + 70.0,
        lx + 20.0,
        ly + 74.0,
    );
}

#[cfg(test)]
mod tests {
    use super::super::stats::{calibration, Round};
    use super::*;

    /// Checks that `doc` is well-formed XML as far as this writer's output goes: every tag closes in order, every
    /// attribute value is quoted, and text and attribute values hold no raw `<` and no `&` outside an entity.
    fn check_well_formed(doc: &str) -> Result<(), String> {
        let body = doc.strip_prefix(r#"<?xml version="1.0" encoding="UTF-8"?>"#).ok_or("no XML declaration")?;
        let check_text = |text: &str| -> Result<(), String> {
            let mut rest = text;
            while let Some(at) = rest.find('&') {
                let entity = &rest[at..];
                if !["&amp;", "&lt;", "&gt;", "&quot;", "&apos;"].iter().any(|e| entity.starts_with(e)) {
                    return Err(format!("a raw & in {text:?}"));
                }
                rest = &rest[at + 1..];
            }
            Ok(())
        };
        let mut stack: Vec<String> = Vec::new();
        let mut rest = body;
        let mut roots = 0;
        while let Some(open) = rest.find('<') {
            check_text(&rest[..open])?;
            if stack.is_empty() && !rest[..open].trim().is_empty() {
                return Err(format!("text outside the root: {:?}", &rest[..open]));
            }
            let close = rest[open..].find('>').ok_or("an unclosed tag")? + open;
            let tag = &rest[open + 1..close];
            if tag.contains('<') {
                return Err(format!("a raw < inside tag {tag:?}"));
            }
            if let Some(name) = tag.strip_prefix('/') {
                let top = stack.pop().ok_or_else(|| format!("</{name}> closes nothing"))?;
                if top != name.trim() {
                    return Err(format!("</{name}> closes <{top}>"));
                }
            } else {
                let self_closing = tag.ends_with('/');
                let inner = tag.trim_end_matches('/');
                let name = inner.split_whitespace().next().ok_or("an empty tag")?;
                let attributes = &inner[name.len()..];
                if attributes.matches('"').count() % 2 != 0 {
                    return Err(format!("unbalanced quotes in <{tag}>"));
                }
                check_text(attributes)?;
                if stack.is_empty() {
                    roots += 1;
                }
                if !self_closing {
                    stack.push(name.to_string());
                }
            }
            rest = &rest[close + 1..];
        }
        if !stack.is_empty() || !rest.trim().is_empty() || roots != 1 {
            return Err(format!("{} tags left open, {roots} roots, trailing {rest:?}", stack.len()));
        }
        Ok(())
    }

    fn rounds() -> Vec<Round> {
        let round = |confidences: &[f64], accepted| Round { confidences: confidences.to_vec(), accepted };
        vec![round(&[0.9, 0.8, 0.5], 2), round(&[0.9, 0.6, 0.3], 0), round(&[0.7, 0.2], 2)]
    }

    #[test]
    fn the_diagram_is_well_formed_with_one_point_per_non_empty_bin() {
        let c = calibration(&rounds(), 4).unwrap();
        let doc = reliability_svg(&c, "k3-tiny <random> & \"its\" drafter");
        check_well_formed(&doc).unwrap();
        let non_empty = c.bins.iter().filter(|b| b.count > 0).count();
        assert_eq!(non_empty, 5);
        assert_eq!(doc.matches(r#"class="bin""#).count(), non_empty);
        // Positions 1..3 were reached, position 4 never was.
        assert_eq!(doc.matches(r#"class="position""#).count(), 3);
        assert_eq!(doc.matches(r#"class="diagonal""#).count(), 1);
        assert!(doc.contains("k3-tiny &lt;random&gt; &amp; &quot;its&quot; drafter"));
    }

    #[test]
    fn no_rounds_draw_the_frame_alone() {
        let doc = reliability_svg(&calibration(&[], 3).unwrap(), "empty");
        check_well_formed(&doc).unwrap();
        assert_eq!(doc.matches(r#"class="bin""#).count() + doc.matches(r#"class="position""#).count(), 0);
    }

    #[test]
    fn the_checker_refuses_broken_documents() {
        let head = r#"<?xml version="1.0" encoding="UTF-8"?>"#;
        for bad in ["<svg><g></svg>", "<svg>a & b</svg>", "<svg/><svg/>", "<svg x=\"1></svg>", "<svg>"] {
            assert!(check_well_formed(&format!("{head}{bad}")).is_err(), "{bad}");
        }
        check_well_formed(&format!("{head}<svg><g a=\"&lt;\">t</g></svg>")).unwrap();
    }
}
