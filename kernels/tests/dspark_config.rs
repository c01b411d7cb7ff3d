//! The drafter configs: the K3 analogue's published numbers, the scaled analogues' share of their
//! target's active bytes, JSON round trips and field-named errors.

use sparkd_kernels::dspark::config::target_active_bytes;
use sparkd_kernels::dspark::DrafterConfig;
use sparkd_kernels::ModelConfig;

const PRESETS: [&str; 4] = ["k3", "k3-tiny", "k3-mini", "k3-mini-wide"];

fn share(name: &str) -> (f64, f64, u64) {
    let target = ModelConfig::preset(name).unwrap();
    let drafter = DrafterConfig::preset(name).unwrap();
    let bytes = drafter.active_bytes() as f64 / target_active_bytes(&target) as f64;
    (bytes, drafter.num_params() as f64, target_active_bytes(&target))
}

#[test]
fn k3_drafter_is_the_published_analogue() {
    let k3 = DrafterConfig::preset("k3").unwrap();
    assert_eq!(k3.target_layer_ids, vec![2, 23, 47, 71, 89]);
    assert_eq!((k3.num_draft_layers, k3.block_size, k3.markov_rank), (5, 7, 256));
    assert_eq!(k3.mla().latent_dim(), 576, "the drafter's MLA cache uses K3's 576-wide latent layout");
    // ~3.56 B parameters (Inferact/Kimi-K3-DSpark, dspark.md §1.5).
    let params = k3.num_params() as f64;
    assert!((params / 3.56e9 - 1.0).abs() < 0.01, "{params}");
}

#[test]
fn drafter_share_of_active_bytes() {
    let (k3_share, _, _) = share("k3");
    for name in PRESETS {
        let (s, params, target_bytes) = share(name);
        println!(
            "{name:>13}: drafter {:.3} M params, target active {:.1} MB/token, drafter share {:.2}% (K3 {:.2}%)",
            params / 1e6,
            target_bytes as f64 / 1e6,
            100.0 * s,
            100.0 * k3_share
        );
        assert!((s / k3_share - 1.0).abs() < 0.15, "{name}: share {s} vs K3 {k3_share}");
    }
}

#[test]
fn configs_round_trip_and_errors_name_the_field() {
    for name in PRESETS {
        let target = ModelConfig::preset(name).unwrap();
        let cfg = DrafterConfig::preset(name).unwrap();
        assert_eq!(DrafterConfig::from_json(&cfg.to_json().unwrap(), &target).unwrap(), cfg);
    }
    let target = ModelConfig::preset("k3-tiny").unwrap();
    let good = DrafterConfig::preset("k3-tiny").unwrap();
    let field_of = |cfg: DrafterConfig| match DrafterConfig::from_json(&cfg.to_json().unwrap(), &target) {
        Err(sparkd_kernels::KernelError::Config { field, .. }) => field,
        other => panic!("expected a config error, got {other:?}"),
    };
    assert_eq!(field_of(DrafterConfig { hidden_size: 64, ..good.clone() }), "drafter.hidden_size");
    assert_eq!(field_of(DrafterConfig { target_layer_ids: vec![2, 1], ..good.clone() }), "drafter.target_layer_ids");
    assert_eq!(field_of(DrafterConfig { target_layer_ids: vec![8], ..good.clone() }), "drafter.target_layer_ids");
    assert_eq!(field_of(DrafterConfig { mask_token_id: 163_840, ..good.clone() }), "drafter.mask_token_id");
    assert_eq!(field_of(DrafterConfig { qk_rope_head_dim: 15, ..good.clone() }), "drafter.qk_rope_head_dim");
    assert_eq!(field_of(DrafterConfig { markov_rank: 0, ..good.clone() }), "drafter.markov_rank");
    let mut json: serde_json::Value = serde_json::from_str(&good.to_json().unwrap()).unwrap();
    json.as_object_mut().unwrap().remove("block_size");
    let err = DrafterConfig::from_json(&json.to_string(), &target).unwrap_err();
    assert!(err.to_string().contains("block_size"), "{err}");
}
