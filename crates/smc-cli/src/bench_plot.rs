//! `smc bench --plot FILE`: an SVG with streaming throughput and ping-pong latency against
//! message size, and aggregate throughput against the number of streams (log-log axes). The
//! floor (what the machine allows, see `bench_floor`) is drawn dashed where a test has one.

use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;

use crate::bench_report::{size_text, Sample};

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

fn colour(transport: &str) -> RGBColor {
    match transport {
        "smc" => RGBColor(200, 30, 30),
        "tcp" => RGBColor(30, 80, 200),
        "floor" => RGBColor(90, 90, 90),
        _ => RGBColor(30, 150, 60),
    }
}

/// One panel: `metric` of `test` for every transport (and mode), x taken by `x` from a sample.
struct Panel<'p> {
    title: &'p str,
    y_desc: &'p str,
    x_desc: &'p str,
    test: &'p str,
    metric: &'p str,
    x: fn(&Sample) -> usize,
    x_label: fn(usize) -> String,
}

fn draw(area: &Area<'_>, p: &Panel<'_>, results: &[Sample]) -> Result<()> {
    let err = |e: &dyn std::fmt::Display| anyhow!("{e}");
    let pts: Vec<&Sample> = results
        .iter()
        .filter(|s| {
            s.test == p.test && s.metric == p.metric && s.value.is_finite() && s.value > 0.0
        })
        .collect();
    if pts.is_empty() {
        return Ok(());
    }
    // x on a log2 axis (sizes and stream counts are powers of 4), labelled with the value.
    let lx = |s: &Sample| ((p.x)(s).max(1) as f64).log2();
    let xmax = pts.iter().map(|s| lx(s)).fold(0.0, f64::max);
    let xmin = pts.iter().map(|s| lx(s)).fold(f64::INFINITY, f64::min);
    let ymin = pts.iter().map(|s| s.value).fold(f64::INFINITY, f64::min);
    let ymax = pts.iter().map(|s| s.value).fold(0.0, f64::max);
    let mut chart = ChartBuilder::on(area)
        .caption(p.title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(
            (xmin - 0.5)..(xmax + 0.5),
            // Headroom above the data for the legend.
            (ymin * 0.5..ymax * 8.0).log_scale(),
        )
        .map_err(|e| err(&e))?;
    let xl = p.x_label;
    let label = move |x: &f64| {
        let n = x.round();
        if (x - n).abs() < 0.01 && (0.0..63.0).contains(&n) && (n as u32).is_multiple_of(2) {
            xl(1usize << (n as u32))
        } else {
            String::new()
        }
    };
    chart
        .configure_mesh()
        .x_desc(p.x_desc)
        .y_desc(p.y_desc)
        .x_labels(((xmax - xmin) as usize + 2).max(2))
        .x_label_formatter(&label)
        .y_labels(8)
        .light_line_style(WHITE)
        .draw()
        .map_err(|e| err(&e))?;
    for transport in ["smc", "tcp", "uds", "floor"] {
        for mode in ["blocking", "busy"] {
            let mut series: Vec<(f64, f64)> = pts
                .iter()
                .filter(|s| s.transport == transport && s.mode == mode)
                .map(|s| (lx(s), s.value))
                .collect();
            if series.is_empty() {
                continue;
            }
            series.sort_by(|a, b| a.0.total_cmp(&b.0));
            let c = colour(transport);
            let style = if mode == "busy" {
                c.mix(0.5).stroke_width(2)
            } else {
                c.stroke_width(2)
            };
            let label = if p.test == "pingpong" {
                format!("{transport} {mode}")
            } else {
                transport.to_string()
            };
            if transport == "floor" {
                chart
                    .draw_series(DashedLineSeries::new(series.clone(), 6, 4, style))
                    .map_err(|e| err(&e))?
                    .label(label)
                    .legend(move |(x, y)| {
                        DashedPathElement::new(vec![(x, y), (x + 20, y)], 6, 4, style)
                    });
            } else {
                chart
                    .draw_series(LineSeries::new(series.clone(), style))
                    .map_err(|e| err(&e))?
                    .label(label)
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
            }
            if mode == "busy" {
                chart
                    .draw_series(series.iter().map(|&pt| Cross::new(pt, 4, style)))
                    .map_err(|e| err(&e))?;
            } else {
                chart
                    .draw_series(series.iter().map(|&pt| Circle::new(pt, 3, style.filled())))
                    .map_err(|e| err(&e))?;
            }
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    Ok(())
}

/// Write the plot of `results` to `path` (SVG).
pub fn plot(results: &[Sample], path: &Path) -> Result<()> {
    let root = SVGBackend::new(path, (1500, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let panels = root.split_evenly((1, 3));
    let defs = [
        Panel {
            title: "Streaming throughput",
            y_desc: "Gbit/s",
            x_desc: "write size",
            test: "stream",
            metric: "gbps",
            x: |s| s.size,
            x_label: size_text,
        },
        Panel {
            title: "Ping-pong round trip, median",
            y_desc: "microseconds",
            x_desc: "message size",
            test: "pingpong",
            metric: "rtt_p50_us",
            x: |s| s.size,
            x_label: size_text,
        },
        Panel {
            title: "Concurrent streams, 64 KiB writes",
            y_desc: "aggregate Gbit/s",
            x_desc: "streams",
            test: "multistream",
            metric: "gbps",
            x: |s| s.streams,
            x_label: |n| n.to_string(),
        },
    ];
    for (area, p) in panels.iter().zip(&defs) {
        draw(area, p, results)?;
    }
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}
