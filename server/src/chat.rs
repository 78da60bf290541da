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
        env.add_template_owned("chat", source.to_string())?;
        Ok(Self {
            env,
            bos_token: bos_token.unwrap_or_default().to_string(),
            eos_token: eos_token.unwrap_or_default().to_string(),
        })
    }

    /// Renders `messages` with `add_generation_prompt`.
    pub fn render(
        &self,
        messages: &[TemplateMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ServerError> {
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| ServerError::Internal(format!("chat template: {e}")))?;
        t.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(|e| match e.kind() {
            // raise_exception() in a template is the model author's message about the input.
            ErrorKind::InvalidOperation => ServerError::invalid("messages", e.to_string()),
            _ => ServerError::invalid(
                "messages",
                format!("the model's chat template could not render these messages: {e}"),
            ),
        })
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
