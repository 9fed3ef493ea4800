//! Chat messages to a prompt: the model's own Jinja chat template (`tokenizer.chat_template` in
//! the GGUF), rendered with minijinja as Hugging Face renders it (trim_blocks, lstrip_blocks,
//! `raise_exception`, Python string methods through minijinja-contrib's pycompat).
//!
//! A file without a template (the Gemma 3 270M GGUF this project tests on has none) gets
//! [`GEMMA_TEMPLATE`], the Gemma 3 instruction format written as a Jinja template, and the server
//! says so (`/v1/models` `chat_template` and a log line at start).

use minijinja::{Environment, ErrorKind};
use serde::Serialize;

/// Gemma 3's chat format: `<start_of_turn>{user|model}\n{text}<end_of_turn>\n`, a system message
/// folded into the first user turn, and `<start_of_turn>model\n` as the generation prompt.
pub const GEMMA_TEMPLATE: &str = r#"{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception('conversation roles must alternate user/assistant/user/assistant/... after an optional system message') }}
    {%- endif -%}
    {%- if message['role'] == 'assistant' -%}
        {%- set role = 'model' -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"#;

/// Where the template came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TemplateSource {
    /// `tokenizer.chat_template` of the GGUF.
    Gguf,
    /// The file has none: [`GEMMA_TEMPLATE`].
    FallbackGemma,
}

impl TemplateSource {
    pub fn describe(self) -> &'static str {
        match self {
            TemplateSource::Gguf => "gguf:tokenizer.chat_template",
            TemplateSource::FallbackGemma => {
                "fallback:gemma (the GGUF has no tokenizer.chat_template)"
            }
        }
    }
}

/// One message as the template sees it.
#[derive(Debug, Clone, Serialize)]
pub struct TemplateMessage {
    pub role: String,
    pub content: String,
}

/// A compiled chat template with the special-token texts it may use.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: TemplateSource,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .finish()
    }
}

const NAME: &str = "chat";

impl ChatTemplate {
    /// Compile `template` (the GGUF's) or, when `None`, the Gemma fallback.
    pub fn new(
        template: Option<&str>,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<ChatTemplate, String> {
        let (text, source) = match template {
            Some(t) => (t.to_string(), TemplateSource::Gguf),
            None => (GEMMA_TEMPLATE.to_string(), TemplateSource::FallbackGemma),
        };
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template_owned(NAME, text)
            .map_err(|e| format!("compiling the chat template ({}): {e}", source.describe()))?;
        Ok(ChatTemplate {
            env,
            source,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    pub fn source(&self) -> TemplateSource {
        self.source
    }

    /// The prompt for `messages`, ending in the generation prompt. A template that refuses the
    /// conversation (`raise_exception`) gives its message.
    pub fn render(&self, messages: &[TemplateMessage]) -> Result<String, String> {
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| format!("chat template: {e}"))?;
        tmpl.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(|e| {
            // `raise_exception` messages are the template's own words; other errors get the
            // template error chain.
            match e.kind() {
                ErrorKind::InvalidOperation => {
                    e.detail().unwrap_or("invalid operation").to_string()
                }
                _ => format!("rendering the chat template: {e:#}"),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> TemplateMessage {
        TemplateMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    fn gemma() -> ChatTemplate {
        ChatTemplate::new(None, "<bos>", "<eos>").unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn gemma_fallback_matches_the_published_format() {
        // The layout of Gemma 3's instruction format as Google's model card shows it.
        let out = gemma()
            .render(&[
                msg("system", "Be brief."),
                msg("user", " Hi "),
                msg("assistant", "Hello."),
                msg("user", "Capital of France?"),
            ])
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            out,
            "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n\
             <start_of_turn>model\nHello.<end_of_turn>\n\
             <start_of_turn>user\nCapital of France?<end_of_turn>\n\
             <start_of_turn>model\n"
        );
        assert_eq!(gemma().source(), TemplateSource::FallbackGemma);
    }

    #[test]
    fn template_refusal_is_its_message() {
        let err = gemma()
            .render(&[msg("assistant", "x")])
            .err()
            .unwrap_or_default();
        assert!(err.contains("must alternate"), "{err}");
    }

    #[test]
    fn gguf_template_is_rendered_with_python_methods() {
        // ChatML as Qwen's GGUFs carry it, using a Python string method.
        let t = ChatTemplate::new(
            Some("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content.strip() }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
            "",
            "<|im_end|>",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(t.source(), TemplateSource::Gguf);
        let out = t
            .render(&[msg("user", " hi ")])
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            out,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn broken_template_is_an_error_not_a_panic() {
        let err = ChatTemplate::new(Some("{% for %}"), "", "")
            .err()
            .unwrap_or_default();
        assert!(err.contains("compiling the chat template"), "{err}");
    }
}
