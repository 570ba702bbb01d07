//! The names drift watches, shared by the drift monitor (`drift.rs`) and
//! the baseline files it compares against (`drift_baseline.rs`): the
//! output features, and which input feature labels can exist.

/// The output features, in the order `drift::values` gives them.
pub const FEATURES: [&str; 5] = [
    "completion_tokens",
    "answer_chars",
    "latency_ms",
    "finish_reason",
    "prompt_tokens",
];

/// Input features a model's version keeps at most (the first ones
/// admitted, or a baseline's).
pub const MAX_INPUT_FEATURES: usize = 32;

/// The longest tensor name kept in a feature label.
pub const MAX_TENSOR_NAME: usize = 48;

pub fn label_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')
}

/// Whether `t` (after `input.`) is a label `drift::oip_inputs` can produce.
pub fn valid_input_label(t: &str) -> bool {
    !t.is_empty() && t.len() <= MAX_TENSOR_NAME + 12 && t.chars().all(label_char)
}
