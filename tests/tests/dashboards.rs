//! The Grafana dashboard and the Prometheus rules under `dashboards/` parse, and every metric they query is one
//! the daemon exports (`sparkd::metrics::ALL_METRICS`).

use std::path::PathBuf;

fn dashboards_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../dashboards")
}

/// Metric names (`vllm:…`, `sparkd:…`) mentioned in a query text, with histogram suffixes stripped.
fn metric_names(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    for prefix in ["vllm:", "sparkd:"] {
        for (start, _) in text.match_indices(prefix) {
            let name: String =
                text[start..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':').collect();
            let base = ["_bucket", "_sum", "_count"].iter().find_map(|s| name.strip_suffix(s)).unwrap_or(&name);
            names.push(base.to_string());
        }
    }
    names
}

fn exported(name: &str) -> bool {
    sparkd::metrics::ALL_METRICS.iter().any(|m| m.name == name)
}

#[test]
fn grafana_dashboard_parses_and_queries_only_exported_metrics() {
    let text = std::fs::read_to_string(dashboards_dir().join("grafana-sparkd.json")).unwrap();
    let dash: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    let panels = dash["panels"].as_array().expect("panels");
    assert!(panels.len() >= 9);
    let mut queried = Vec::new();
    for panel in panels {
        assert!(panel["title"].is_string());
        for target in panel["targets"].as_array().expect("targets") {
            queried.extend(metric_names(target["expr"].as_str().expect("expr")));
        }
    }
    for needed in [
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "sparkd:interactivity_p90_tokens_per_second",
        "sparkd:errors_total",
        "sparkd:state_memory_bytes",
        "vllm:prefix_cache_hits_total",
        "sparkd:engine_phase_seconds",
    ] {
        assert!(queried.iter().any(|q| q == needed), "dashboard lacks {needed}");
    }
    for name in &queried {
        assert!(exported(name), "dashboard queries {name}, which sparkd does not export");
    }
}

#[test]
fn recording_rules_use_exported_metrics_and_the_scrape_config_loads_them() {
    let rules = std::fs::read_to_string(dashboards_dir().join("sparkd-rules.yml")).unwrap();
    let mut records = 0;
    for line in rules.lines() {
        let line = line.trim();
        if let Some(name) = line.strip_prefix("- record: ") {
            records += 1;
            assert!(name.starts_with("sparkd:"), "{name}");
        }
        if let Some(expr) = line.strip_prefix("expr: ") {
            for name in metric_names(expr) {
                let is_rule = rules.contains(&format!("record: {name}"));
                assert!(exported(&name) || is_rule, "rule uses {name}, which is neither exported nor recorded");
            }
        }
    }
    assert!(records >= 12);
    let scrape = std::fs::read_to_string(dashboards_dir().join("prometheus.yml")).unwrap();
    assert!(scrape.contains("sparkd-rules.yml") && scrape.contains("metrics_path: /metrics"));
}
