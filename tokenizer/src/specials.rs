//! K3's special tokens: names, real ids, and reading them from `tokenizer_config.json`.
//!
//! Invariants: the reserved range holds exactly [`NUM_RESERVED_SPECIAL_TOKENS`] ids starting at the
//! special base; every id in it gets exactly one name (a published one, or `<|reserved_token_{id}|>`).
//! Ids of `added_tokens_decoder` outside the range are ignored, as Kimi's `tokenization_kimi.py` does.
//!
//! Source of the ids: Kimi K2's `tokenizer_config.json` `added_tokens_decoder` (K3 keeps the same
//! tokenizer): `[BOS]` 163584, `[EOS]` 163585, `<|im_end|>` 163586, `<|im_user|>` 163587,
//! `<|im_assistant|>` 163588, `<|start_header_id|>` 163590, `<|end_header_id|>` 163591, `[EOT]` 163593,
//! `<|im_system|>` 163594, the tool-call markers 163595..=163599, `<|im_middle|>` 163601, `[UNK]` 163838,
//! `[PAD]` 163839.

use serde_json::Value;

/// Size of Kimi's reserved special-token range.
pub const NUM_RESERVED_SPECIAL_TOKENS: usize = 256;
/// The first special id of K3 (its base vocabulary holds 163,584 tokens).
pub const K3_SPECIAL_BASE: u32 = 163_584;
/// K3's vocabulary size: `K3_SPECIAL_BASE + 256`.
pub const K3_VOCAB_SIZE: usize = K3_SPECIAL_BASE as usize + NUM_RESERVED_SPECIAL_TOKENS;

pub const BOS: &str = "[BOS]";
pub const EOS: &str = "[EOS]";
pub const IM_END: &str = "<|im_end|>";
pub const IM_USER: &str = "<|im_user|>";
pub const IM_ASSISTANT: &str = "<|im_assistant|>";
pub const IM_SYSTEM: &str = "<|im_system|>";
pub const IM_MIDDLE: &str = "<|im_middle|>";
/// The tool-call markers of an assistant turn (docs/agent-formats.md).
pub const TOOL_CALLS_SECTION_BEGIN: &str = "<|tool_calls_section_begin|>";
pub const TOOL_CALLS_SECTION_END: &str = "<|tool_calls_section_end|>";
pub const TOOL_CALL_BEGIN: &str = "<|tool_call_begin|>";
pub const TOOL_CALL_ARGUMENT_BEGIN: &str = "<|tool_call_argument_begin|>";
pub const TOOL_CALL_END: &str = "<|tool_call_end|>";
pub const UNK: &str = "[UNK]";
pub const PAD: &str = "[PAD]";

/// K3's published special tokens as (offset from the special base, name).
pub const K3_NAMED_SPECIALS: [(u32, &str); 17] = [
    (0, BOS),
    (1, EOS),
    (2, IM_END),
    (3, IM_USER),
    (4, IM_ASSISTANT),
    (6, "<|start_header_id|>"),
    (7, "<|end_header_id|>"),
    (9, "[EOT]"),
    (10, IM_SYSTEM),
    (11, TOOL_CALLS_SECTION_BEGIN),
    (12, TOOL_CALLS_SECTION_END),
    (13, TOOL_CALL_BEGIN),
    (14, TOOL_CALL_ARGUMENT_BEGIN),
    (15, TOOL_CALL_END),
    (17, IM_MIDDLE),
    (254, UNK),
    (255, PAD),
];

/// The name of an unnamed reserved id, as `tokenization_kimi.py` writes it.
pub fn reserved_name(id: u32) -> String {
    format!("<|reserved_token_{id}|>")
}

/// Names for the reserved range starting at `base`: K3's published names at their offsets, the rest
/// `<|reserved_token_{id}|>`.
pub fn k3_names(base: u32) -> Vec<String> {
    let mut names: Vec<String> = (0..NUM_RESERVED_SPECIAL_TOKENS as u32).map(|i| reserved_name(base + i)).collect();
    for (offset, name) in K3_NAMED_SPECIALS {
        names[offset as usize] = name.to_string();
    }
    names
}

/// Names for the reserved range starting at `base` from a `tokenizer_config.json` text: the `content` of
/// each `added_tokens_decoder` entry whose id falls in the range, `<|reserved_token_{id}|>` elsewhere.
pub fn names_from_config(config_json: &str, base: u32) -> Result<Vec<String>, String> {
    let config: Value = serde_json::from_str(config_json).map_err(|e| format!("not valid JSON: {e}"))?;
    let mut names: Vec<String> = (0..NUM_RESERVED_SPECIAL_TOKENS as u32).map(|i| reserved_name(base + i)).collect();
    let Some(decoder) = config.get("added_tokens_decoder") else {
        return Ok(names);
    };
    let decoder = decoder.as_object().ok_or("`added_tokens_decoder` is not an object")?;
    for (key, entry) in decoder {
        let id: u32 = key.parse().map_err(|_| format!("`added_tokens_decoder` key {key:?} is not a token id"))?;
        let content = entry
            .get("content")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("`added_tokens_decoder[{key}].content` is missing or not a string"))?;
        if content.is_empty() {
            return Err(format!("`added_tokens_decoder[{key}].content` is empty"));
        }
        if let Some(offset) = id.checked_sub(base).filter(|o| (*o as usize) < NUM_RESERVED_SPECIAL_TOKENS) {
            names[offset as usize] = content.to_string();
        }
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn k3_names_sit_at_their_real_ids() {
        let names = k3_names(K3_SPECIAL_BASE);
        assert_eq!(names.len(), 256);
        assert_eq!(names[0], "[BOS]");
        assert_eq!(names[(163_586 - K3_SPECIAL_BASE) as usize], "<|im_end|>");
        assert_eq!(names[(163_601 - K3_SPECIAL_BASE) as usize], "<|im_middle|>");
        assert_eq!(names[(163_839 - K3_SPECIAL_BASE) as usize], "[PAD]");
        assert_eq!(names[5], "<|reserved_token_163589|>");
        assert_eq!(K3_VOCAB_SIZE, 163_840);
    }

    #[test]
    fn config_names_override_reserved_names_inside_the_range_only() {
        let config = r#"{"added_tokens_decoder": {
            "10": {"content": "<|a|>"}, "12": {"content": "<|b|>"}, "3": {"content": "<|outside|>"}}}"#;
        let names = names_from_config(config, 10).unwrap();
        assert_eq!(names[0], "<|a|>");
        assert_eq!(names[1], "<|reserved_token_11|>");
        assert_eq!(names[2], "<|b|>");
        assert!(!names.iter().any(|n| n == "<|outside|>"));
        assert!(names_from_config("{", 10).unwrap_err().contains("JSON"));
        assert!(names_from_config(r#"{"added_tokens_decoder": {"x": {"content": "a"}}}"#, 0)
            .unwrap_err()
            .contains("not a token id"));
    }
}
