//! Chat prompts: `messages` rendered with the model's chat template (Jinja, from
//! `tokenizer_config.json`) through minijinja with Python-compatible string methods, as
//! transformers' `apply_chat_template` does.
use minijinja::{context, Environment, Error, ErrorKind};
use serde::Serialize;

use crate::error::ServerError;

/// One message as the template sees it (text content only).
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct TemplateMessage {
    pub role: String,
    pub content: String,
}

/// Template instructions a render may run before it is stopped, whatever the messages: a
/// template from a model directory is outside input, and one that loops forever must end in
/// an error, not a hung handler.
pub const TEMPLATE_FUEL_BASE: u64 = 2_000_000;
/// More fuel per message: real templates spend tens of instructions on each.
pub const TEMPLATE_FUEL_PER_MESSAGE: u64 = 500;
/// Bytes a render may write: far above any prompt a model takes, low enough that a template
/// repeating a large message many times fails instead of exhausting memory.
pub const TEMPLATE_OUTPUT_LIMIT: usize = 64 << 20;
/// Nesting depth (loops, ifs, macro calls) a render may reach; minijinja's own cap is 500.
pub const TEMPLATE_RECURSION_LIMIT: usize = 100;

/// A compiled chat template plus the special tokens it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

fn raise_exception(msg: String) -> Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

impl ChatTemplate {
    /// Compiles `source`; an invalid template is an error at start-up, not per request.
    pub fn new(
        source: &str,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<Self, Error> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_recursion_limit(TEMPLATE_RECURSION_LIMIT);
        env.add_template_owned("chat", source.to_string())?;
        Ok(Self {
            env,
            bos_token: bos_token.unwrap_or_default().to_string(),
            eos_token: eos_token.unwrap_or_default().to_string(),
        })
    }

    /// Renders `messages` with `add_generation_prompt`, within a fuel budget that grows with
    /// the number of messages. Messages reach the template as data (context values), never as
    /// template source.
    pub fn render(
        &self,
        messages: &[TemplateMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ServerError> {
        // Fuel is a setting of the environment; a clone shares the compiled template (Arc).
        let mut env = self.env.clone();
        env.set_fuel(Some(TEMPLATE_FUEL_BASE.saturating_add(
            TEMPLATE_FUEL_PER_MESSAGE.saturating_mul(messages.len() as u64),
        )));
        let t = env
            .get_template("chat")
            .map_err(|e| ServerError::Internal(format!("chat template: {e}")))?;
        let mut out = CappedWriter(Vec::new());
        t.render_captured_to(
            context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            },
            &mut out,
        )
        .map_err(|e| match e.kind() {
            // raise_exception() in a template is the model author's message about the input.
            ErrorKind::InvalidOperation => ServerError::invalid("messages", e.to_string()),
            ErrorKind::OutOfFuel => ServerError::invalid(
                "messages",
                "the model's chat template ran past its instruction budget while rendering \
                     these messages (a template that loops without end, or far too many \
                     messages); fix the template in tokenizer_config.json or send fewer messages",
            ),
            ErrorKind::WriteFailure => ServerError::invalid(
                "messages",
                format!(
                    "the model's chat template wrote more than {} MiB for these messages; send \
                     shorter messages",
                    TEMPLATE_OUTPUT_LIMIT >> 20
                ),
            ),
            _ => ServerError::invalid(
                "messages",
                format!("the model's chat template could not render these messages: {e}"),
            ),
        })?;
        // minijinja writes whole UTF-8 strings.
        String::from_utf8(out.0)
            .map_err(|_| ServerError::Internal("the chat template wrote invalid UTF-8".into()))
    }
}

/// A sink that refuses to grow past [`TEMPLATE_OUTPUT_LIMIT`].
struct CappedWriter(Vec<u8>);

impl std::io::Write for CappedWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.0.len() + buf.len() > TEMPLATE_OUTPUT_LIMIT {
            return Err(std::io::Error::other("chat template output limit"));
        }
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gen::CHAT_TEMPLATE;

    #[test]
    fn renders_chatml_with_generation_prompt() {
        let t = ChatTemplate::new(CHAT_TEMPLATE, Some("<s>"), Some("</s>")).unwrap();
        let msgs = [
            TemplateMessage {
                role: "system".into(),
                content: "Be brief.".into(),
            },
            TemplateMessage {
                role: "user".into(),
                content: "Hi!".into(),
            },
        ];
        let out = t.render(&msgs, true).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    fn user(content: &str) -> TemplateMessage {
        TemplateMessage {
            role: "user".into(),
            content: content.into(),
        }
    }

    /// Templates that never end, or recurse without bound, stop with an error; the same
    /// template object keeps rendering afterwards.
    #[test]
    fn hostile_templates_are_bounded() {
        let forever =
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x";
        let recursive = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}";
        let repeater = "{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}";
        for src in [forever, recursive, repeater] {
            let t = ChatTemplate::new(src, None, None).unwrap();
            for _ in 0..2 {
                let e = t.render(&[user(&"y".repeat(4096))], true).unwrap_err();
                assert_eq!(e.status(), 400, "{e}");
            }
        }
        let t = ChatTemplate::new(forever, None, None).unwrap();
        let e = t.render(&[user("hi")], true).unwrap_err();
        assert!(e.to_string().contains("instruction budget"), "{e}");
    }

    /// Message text is data: Jinja syntax in it is rendered verbatim, never evaluated.
    #[test]
    fn request_strings_are_data() {
        let t = ChatTemplate::new(CHAT_TEMPLATE, None, None).unwrap();
        let evil = "{{ 7*7 }}{% for i in range(99999999) %}{% endfor %}{{ raise_exception('x') }}";
        let out = t.render(&[user(evil)], false).unwrap();
        assert!(out.contains(evil), "{out}");
        assert!(!out.contains("49"));
    }

    #[test]
    fn python_methods_and_raise_exception_work() {
        let src = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}{{ bos_token }}{{ messages[0]['content'].strip() }}";
        let t = ChatTemplate::new(src, Some("<s>"), None).unwrap();
        let m = |role: &str| TemplateMessage {
            role: role.into(),
            content: "  x ".into(),
        };
        assert_eq!(t.render(&[m("user")], false).unwrap(), "<s>x");
        let err = t.render(&[m("system")], false).unwrap_err();
        assert_eq!(err.status(), 400);
        assert!(err.to_string().contains("first must be user"));
    }
}
