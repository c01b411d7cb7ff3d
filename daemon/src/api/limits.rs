//! The per-request size limits (`--max-prompt-chars`, `--max-stop-strings`, `--max-stop-chars`,
//! `--max-logprobs`), checked while a request is validated, before any tokenizing or matcher building.
//!
//! Invariants:
//! - Each limit refused is a 400 that names the request field and the server flag that sets the limit.
//! - The prompt is measured in characters (Unicode scalar values) of everything the template renders from the
//!   request: message contents, reasoning, tool-call arguments and names, and the tools' declaration.

use sparkd_tokenizer::ChatMessage;

use super::error::ApiError;

/// Most stop strings per request (the OpenAI API allows 4; vLLM and agent frameworks send more).
pub const DEFAULT_MAX_STOP_STRINGS: usize = 16;
/// Longest stop string, in characters.
pub const DEFAULT_MAX_STOP_CHARS: usize = 4096;
/// Most alternatives per token in `top_logprobs` / legacy `logprobs` (vLLM's default `--max-logprobs`).
pub const DEFAULT_MAX_LOGPROBS: usize = 20;
/// Prompt characters allowed per token of the context when `--max-prompt-chars` is not given: a prompt that
/// fills a 131,072-token context with ordinary text or code takes 3-5 characters per token, so 32 leaves room
/// for any real prompt while refusing, before it is tokenized, text that could never fit.
pub const PROMPT_CHARS_PER_TOKEN: usize = 32;

/// What one request may ask for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestLimits {
    pub max_prompt_chars: usize,
    pub max_stop_strings: usize,
    pub max_stop_chars: usize,
    pub max_logprobs: usize,
}

impl RequestLimits {
    /// The defaults for a context of `max_model_len` tokens.
    pub fn for_context(max_model_len: usize) -> Self {
        RequestLimits {
            max_prompt_chars: max_model_len.saturating_mul(PROMPT_CHARS_PER_TOKEN),
            max_stop_strings: DEFAULT_MAX_STOP_STRINGS,
            max_stop_chars: DEFAULT_MAX_STOP_CHARS,
            max_logprobs: DEFAULT_MAX_LOGPROBS,
        }
    }

    /// Refuses a prompt of more than `--max-prompt-chars` characters; `field` names it in the request.
    pub fn check_prompt(&self, field: &str, chars: usize) -> Result<(), ApiError> {
        if chars > self.max_prompt_chars {
            return Err(ApiError::field(
                field,
                format!(
                    "the prompt is {chars} characters, more than this server accepts ({}, --max-prompt-chars)",
                    self.max_prompt_chars
                ),
            ));
        }
        Ok(())
    }

    /// Refuses more than `--max-stop-strings` stop strings, or one longer than `--max-stop-chars`.
    pub fn check_stop(&self, stop: &[String]) -> Result<(), ApiError> {
        if stop.len() > self.max_stop_strings {
            return Err(ApiError::field(
                "stop",
                format!(
                    "`stop` holds at most {} strings (--max-stop-strings), got {}",
                    self.max_stop_strings,
                    stop.len()
                ),
            ));
        }
        for (i, s) in stop.iter().enumerate() {
            // Bytes bound characters from above: count only when the bytes could be over.
            let chars = if s.len() > self.max_stop_chars { s.chars().count() } else { 0 };
            if chars > self.max_stop_chars {
                return Err(ApiError::field(
                    format!("stop[{i}]"),
                    format!(
                        "`stop[{i}]` is {chars} characters, longer than this server accepts ({}, --max-stop-chars)",
                        self.max_stop_chars
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Refuses more than `--max-logprobs` alternatives per token in `field`.
    pub fn check_logprobs(&self, field: &str, n: usize) -> Result<(), ApiError> {
        if n > self.max_logprobs {
            return Err(ApiError::field(
                field,
                format!("`{field}` is {n}, more than this server returns ({}, --max-logprobs)", self.max_logprobs),
            ));
        }
        Ok(())
    }
}

/// Characters the template renders from `messages` and the tools' declaration.
pub fn chat_chars(messages: &[ChatMessage], tools: Option<&str>) -> usize {
    let message = |m: &ChatMessage| {
        m.content.chars().count()
            + m.reasoning.as_deref().map_or(0, |r| r.chars().count())
            + m.tool_calls.iter().map(|c| c.name.chars().count() + c.arguments.chars().count()).sum::<usize>()
    };
    messages.iter().map(message).sum::<usize>() + tools.map_or(0, |t| t.chars().count())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_limit_is_a_400_naming_the_field_and_the_flag() {
        let limits = RequestLimits { max_prompt_chars: 10, max_stop_strings: 2, max_stop_chars: 3, max_logprobs: 5 };
        let e = limits.check_prompt("messages", 11).unwrap_err();
        assert_eq!(e.param(), Some("messages"));
        assert!(e.to_string().contains("--max-prompt-chars"), "{e}");
        assert!(limits.check_prompt("messages", 10).is_ok());

        let e = limits.check_stop(&["a".into(), "b".into(), "c".into()]).unwrap_err();
        assert_eq!(e.param(), Some("stop"));
        assert!(e.to_string().contains("--max-stop-strings"), "{e}");
        // Three characters of six bytes are within a three-character limit.
        assert!(limits.check_stop(&["ééé".into()]).is_ok());
        let e = limits.check_stop(&["ok".into(), "four".into()]).unwrap_err();
        assert_eq!(e.param(), Some("stop[1]"));
        assert!(e.to_string().contains("--max-stop-chars"), "{e}");

        let e = limits.check_logprobs("top_logprobs", 6).unwrap_err();
        assert_eq!(e.param(), Some("top_logprobs"));
        assert!(e.to_string().contains("--max-logprobs"), "{e}");
    }

    #[test]
    fn chat_prompts_count_every_rendered_text_in_characters() {
        let mut m = ChatMessage::new("assistant", "héllo");
        m.reasoning = Some("hm".into());
        m.tool_calls.push(sparkd_tokenizer::ToolCall {
            id: "functions.f:0".into(),
            name: "f".into(),
            arguments: "{}".into(),
        });
        assert_eq!(chat_chars(&[m, ChatMessage::new("user", "日本")], Some("[tools]")), 5 + 2 + 1 + 2 + 2 + 7);
    }

    #[test]
    fn the_default_prompt_limit_follows_the_context() {
        assert_eq!(RequestLimits::for_context(131_072).max_prompt_chars, 131_072 * PROMPT_CHARS_PER_TOKEN);
        assert_eq!(RequestLimits::for_context(usize::MAX).max_prompt_chars, usize::MAX);
    }
}
