//! Names computed from an event: routing keys, exchanges and subjects written as templates
//! such as `outbox.{topic}` or `{aggregate_type}.events`. A template is parsed once at start
//! (so a typo is a configuration error with the fix, not a failure per event) and rendered per
//! event through a lookup of the event's fields. `{{` and `}}` stand for literal braces.

use std::borrow::Cow;
use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Lit(String),
    Var(String),
}

/// A parsed template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    source: String,
    parts: Vec<Part>,
}

/// Why a template does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("template {template:?}: {problem}")]
pub struct TemplateError {
    pub template: String,
    pub problem: String,
}

impl Template {
    /// Parses `text`; a placeholder is `{name}` with `name` of letters, digits, `_` and `-`.
    pub fn parse(text: &str) -> Result<Template, TemplateError> {
        let err = |problem: String| TemplateError {
            template: text.to_string(),
            problem,
        };
        let mut parts = Vec::new();
        let mut lit = String::new();
        let mut chars = text.char_indices().peekable();
        while let Some((i, c)) = chars.next() {
            match c {
                '{' if chars.peek().map(|&(_, c)| c) == Some('{') => {
                    chars.next();
                    lit.push('{');
                }
                '}' if chars.peek().map(|&(_, c)| c) == Some('}') => {
                    chars.next();
                    lit.push('}');
                }
                '{' => {
                    let rest = &text[i + 1..];
                    let end = rest.find('}').ok_or_else(|| {
                        err(format!(
                            "the placeholder at byte {i} is not closed with '}}' (write '{{{{' for a literal brace)"
                        ))
                    })?;
                    let name = &rest[..end];
                    if name.is_empty()
                        || !name
                            .chars()
                            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
                    {
                        return Err(err(format!(
                            "{{{name}}} is not a placeholder: a name is letters, digits, '_' or '-', e.g. {{topic}}"
                        )));
                    }
                    if !lit.is_empty() {
                        parts.push(Part::Lit(std::mem::take(&mut lit)));
                    }
                    parts.push(Part::Var(name.to_string()));
                    for _ in 0..name.chars().count() + 1 {
                        chars.next();
                    }
                }
                '}' => {
                    return Err(err(format!(
                    "a '}}' at byte {i} closes no placeholder (write '}}}}' for a literal brace)"
                )))
                }
                c => lit.push(c),
            }
        }
        if !lit.is_empty() {
            parts.push(Part::Lit(lit));
        }
        Ok(Template {
            source: text.to_string(),
            parts,
        })
    }

    /// The placeholder names, in order of appearance (repeats included).
    pub fn vars(&self) -> impl Iterator<Item = &str> {
        self.parts.iter().filter_map(|p| match p {
            Part::Var(v) => Some(v.as_str()),
            Part::Lit(_) => None,
        })
    }

    /// Whether the template has no placeholder (renders the same for every event).
    pub fn is_constant(&self) -> bool {
        self.vars().next().is_none()
    }

    /// Checks every placeholder against the names an event can supply, at start.
    pub fn check_vars<'a>(
        &self,
        known: impl IntoIterator<Item = &'a str> + Clone,
    ) -> Result<(), TemplateError> {
        for v in self.vars() {
            if !known.clone().into_iter().any(|k| k == v) {
                let names: Vec<&str> = known.clone().into_iter().collect();
                return Err(TemplateError {
                    template: self.source.clone(),
                    problem: format!(
                        "no field {{{v}}}: a template can use {}",
                        names
                            .iter()
                            .map(|n| format!("{{{n}}}"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                });
            }
        }
        Ok(())
    }

    /// Renders with `lookup`; the error names a placeholder the event has no value for.
    pub fn render<'a>(
        &self,
        lookup: impl Fn(&str) -> Option<Cow<'a, str>>,
    ) -> Result<String, String> {
        let mut out = String::new();
        for p in &self.parts {
            match p {
                Part::Lit(s) => out.push_str(s),
                Part::Var(v) => match lookup(v) {
                    Some(val) => out.push_str(&val),
                    None => {
                        return Err(format!(
                            "template {:?}: the event has no value for {{{v}}}",
                            self.source
                        ))
                    }
                },
            }
        }
        Ok(out)
    }
}

impl fmt::Display for Template {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

impl std::str::FromStr for Template {
    type Err = TemplateError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Template::parse(s)
    }
}

/// The fields every event has, by the names templates use: `id`, `topic`, `aggregate_id`,
/// and `table` (the outbox table, when the relay reads several); any other name is one of the
/// row's extra columns (see `names::ColumnMap::require_extra`), absent when NULL.
pub(crate) fn event_field<'a>(
    event: &'a crate::event::OutboxEvent,
    name: &str,
) -> Option<Cow<'a, str>> {
    match name {
        "id" => Some(Cow::Owned(event.id.hyphenated().to_string())),
        "topic" => Some(Cow::Borrowed(event.topic.as_str())),
        "aggregate_id" => Some(Cow::Borrowed(event.aggregate_id.as_str())),
        "table" => event.table.as_deref().map(Cow::Borrowed),
        _ => event.extra_value(name).map(Cow::Borrowed),
    }
}

/// The names [`event_field`] knows.
pub use crate::names::EVENT_FIELDS;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_renders_with_escapes() {
        let t = Template::parse("outbox.{topic}.{{v1}}.{aggregate_id}").unwrap();
        assert_eq!(t.vars().collect::<Vec<_>>(), ["topic", "aggregate_id"]);
        let ev = crate::sink::test_event();
        let out = t.render(|n| event_field(&ev, n)).unwrap();
        assert_eq!(out, "outbox.invoice.issued.{v1}.agg-1");
        assert!(Template::parse("plain").unwrap().is_constant());
    }

    #[test]
    fn bad_templates_say_what_is_wrong() {
        for (t, needle) in [
            ("outbox.{topic", "not closed"),
            ("outbox.{}", "not a placeholder"),
            ("outbox.{a b}", "not a placeholder"),
            ("outbox}", "closes no placeholder"),
        ] {
            let e = Template::parse(t).unwrap_err();
            assert!(e.to_string().contains(needle), "{t}: {e}");
        }
        let t = Template::parse("{tpoic}").unwrap();
        let e = t.check_vars(EVENT_FIELDS.iter().copied()).unwrap_err();
        assert!(e.to_string().contains("no field {tpoic}"), "{e}");
        assert!(e.to_string().contains("{topic}"), "{e}");
        let ev = crate::sink::test_event();
        let missing = Template::parse("{table}")
            .unwrap()
            .render(|n| event_field(&ev, n));
        assert!(missing.unwrap_err().contains("no value for {table}"));
    }
}
