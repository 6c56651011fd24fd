//! The schema that says which payload fields are personal data: `"x-gdpr-sensitive": true` on a
//! field, either JSON Schema style (`properties`, nested objects, `items` for every element of
//! an array) or a flat form (`{"tax_id": {"x-gdpr-sensitive": true}}`). A marker the
//! walker would not reach (under `$ref`, `allOf`, `patternProperties`, …) is refused rather
//! than ignored: ignoring it would leave personal data in clear while the operator believes
//! it encrypted.

use super::blind::Normalize;
use super::error::CryptoError;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

pub const MARKER: &str = "x-gdpr-sensitive";
/// Optional per-field blind-index settings: `{"normalize": ["trim", "lowercase"]}`.
pub const BLIND_MARKER: &str = "x-blind-index";

/// One node of the compiled schema.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Node {
    /// Encrypt this value whole (whatever its type).
    pub sensitive: bool,
    /// Object members to look into.
    pub props: BTreeMap<String, Node>,
    /// Every array element.
    pub items: Option<Box<Node>>,
    /// Blind-index normalisation declared for this field.
    pub normalize: Option<Vec<Normalize>>,
}

impl Node {
    fn has_sensitive(&self) -> bool {
        self.sensitive
            || self.props.values().any(Node::has_sensitive)
            || self.items.as_ref().is_some_and(|i| i.has_sensitive())
    }
}

/// A compiled schema.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Schema {
    pub root: Node,
}

fn err(problem: impl Into<String>, fix: impl Into<String>) -> CryptoError {
    CryptoError::Schema {
        problem: problem.into(),
        fix: fix.into(),
    }
}

fn escape(seg: &str) -> String {
    seg.replace('~', "~0").replace('/', "~1")
}

impl Schema {
    pub fn load(path: &Path) -> Result<Schema, CryptoError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            err(
                format!("cannot read {}: {e}", path.display()),
                "point --schema at the JSON schema file",
            )
        })?;
        let v: Value = serde_json::from_str(&text).map_err(|e| {
            err(
                format!("{} is not JSON: {e}", path.display()),
                "fix the JSON syntax",
            )
        })?;
        Schema::from_value(&v)
    }

    pub fn from_value(v: &Value) -> Result<Schema, CryptoError> {
        let top = v.as_object().ok_or_else(|| {
            err(
                "the schema is not a JSON object",
                r#"write {"properties": {"tax_id": {"x-gdpr-sensitive": true}}} or {"tax_id": {"x-gdpr-sensitive": true}}"#,
            )
        })?;
        let mut reached = BTreeSet::new();
        // JSON Schema style when the top level has a `properties` object that is not itself a
        // field definition of the flat form (a flat field called "properties" carries the
        // marker or is not an object of objects).
        let json_schema = match top.get("properties") {
            Some(Value::Object(p)) => !p.contains_key(MARKER) && p.values().all(Value::is_object),
            _ => false,
        };
        let root = if json_schema {
            if top.get(MARKER) == Some(&Value::Bool(true)) {
                return Err(err(
                    "the whole payload is marked sensitive",
                    "mark the personal fields, not the root: routing fields must stay clear",
                ));
            }
            compile(v, "", &mut reached)?
        } else {
            let mut root = Node::default();
            for (k, field) in top {
                let doc = format!("/{}", escape(k));
                if !field.is_object() {
                    return Err(err(
                        format!("field {k:?} is defined by {field}, not an object"),
                        format!(r#"write "{k}": {{"x-gdpr-sensitive": true}}"#),
                    ));
                }
                root.props
                    .insert(k.clone(), compile(field, &doc, &mut reached)?);
            }
            root
        };
        // Every marker in the document must have been reached by the walk.
        let mut all = BTreeSet::new();
        find_markers(v, "", &mut all);
        if let Some(missed) = all.difference(&reached).next() {
            return Err(err(
                format!("the {MARKER} marker at {missed} is under a keyword outboxd does not follow ($ref, allOf, anyOf, oneOf, patternProperties, additionalProperties, tuple items, …)"),
                "inline the field under \"properties\" (objects) or \"items\" (arrays)",
            ));
        }
        Ok(Schema { root })
    }

    /// The flat form from a list of pointers (`/tax_id`, `/customer/name`, `/items/*/name`).
    pub fn from_pointers<S: AsRef<str>>(pointers: &[S]) -> Schema {
        let mut root = Node::default();
        for p in pointers {
            let mut node = &mut root;
            for seg in p.as_ref().trim_start_matches('/').split('/') {
                let seg = seg.replace("~1", "/").replace("~0", "~");
                node = if seg == "*" {
                    node.items.get_or_insert_with(Default::default)
                } else {
                    node.props.entry(seg).or_default()
                };
            }
            node.sensitive = true;
        }
        Schema { root }
    }

    /// Whether any field is marked (a schema marking nothing is almost certainly a mistake).
    pub fn has_sensitive(&self) -> bool {
        self.root.has_sensitive()
    }

    /// The marked fields as pointers, `*` standing for every array element.
    pub fn sensitive_pointers(&self) -> Vec<String> {
        fn walk(n: &Node, at: &str, out: &mut Vec<String>) {
            if n.sensitive {
                out.push(at.to_string());
                return;
            }
            for (k, c) in &n.props {
                walk(c, &format!("{at}/{}", escape(k)), out);
            }
            if let Some(i) = &n.items {
                walk(i, &format!("{at}/*"), out);
            }
        }
        let mut out = Vec::new();
        walk(&self.root, "", &mut out);
        out
    }

    /// The blind-index normalisation the schema declares for `pointer` (array indices match
    /// `items`).
    pub fn normalization(&self, pointer: &str) -> Option<Vec<Normalize>> {
        let mut node = &self.root;
        for seg in pointer.trim_start_matches('/').split('/') {
            let seg = seg.replace("~1", "/").replace("~0", "~");
            node = match node.props.get(&seg) {
                Some(n) => n,
                None => node.items.as_deref()?,
            };
        }
        node.normalize.clone()
    }
}

fn compile(v: &Value, doc: &str, reached: &mut BTreeSet<String>) -> Result<Node, CryptoError> {
    let Some(obj) = v.as_object() else {
        return Ok(Node::default());
    };
    let mut node = Node::default();
    match obj.get(MARKER) {
        None | Some(Value::Bool(false)) => {}
        Some(Value::Bool(true)) => {
            node.sensitive = true;
            reached.insert(doc.to_string());
        }
        Some(other) => {
            return Err(err(
                format!("{MARKER} at {doc} is {other}, not true or false"),
                format!(r#"write "{MARKER}": true"#),
            ))
        }
    }
    if let Some(b) = obj.get(BLIND_MARKER) {
        let steps = match b.get("normalize") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|s| {
                    s.as_str()
                        .ok_or_else(|| {
                            err(
                                format!("{BLIND_MARKER}.normalize at {doc} holds a non-string"),
                                r#"write "normalize": ["trim", "lowercase"]"#,
                            )
                        })
                        .and_then(Normalize::parse)
                })
                .collect::<Result<Vec<_>, _>>()?,
            Some(Value::String(s)) => Normalize::parse_list(s)?,
            None => super::blind::DEFAULT_NORMALIZE.to_vec(),
            Some(other) => {
                return Err(err(
                    format!("{BLIND_MARKER}.normalize at {doc} is {other}"),
                    r#"write "normalize": ["trim", "lowercase"]"#,
                ))
            }
        };
        node.normalize = Some(steps);
    }
    if let Some(props) = obj.get("properties") {
        let props = props.as_object().ok_or_else(|| {
            err(
                format!("\"properties\" at {doc} is not an object"),
                "write \"properties\": {\"field\": {…}}",
            )
        })?;
        for (k, child) in props {
            let child_doc = format!("{doc}/properties/{}", escape(k));
            let c = compile(child, &child_doc, reached)?;
            // Inside a sensitive value everything is encrypted with it: markers there are
            // reached, but the walker need not descend.
            node.props.insert(k.clone(), c);
        }
    }
    if let Some(items @ Value::Object(_)) = obj.get("items") {
        node.items = Some(Box::new(compile(items, &format!("{doc}/items"), reached)?));
    }
    Ok(node)
}

fn find_markers(v: &Value, at: &str, out: &mut BTreeSet<String>) {
    match v {
        Value::Object(o) => {
            if o.get(MARKER) == Some(&Value::Bool(true)) {
                out.insert(at.to_string());
            }
            for (k, c) in o {
                find_markers(c, &format!("{at}/{}", escape(k)), out);
            }
        }
        Value::Array(a) => {
            for (i, c) in a.iter().enumerate() {
                find_markers(c, &format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn flat_form_of_the_seed() {
        let s = Schema::from_value(&json!({
            "invoice_id": {"x-gdpr-sensitive": false},
            "customer_name": {"x-gdpr-sensitive": true},
            "tax_id": {"x-gdpr-sensitive": true},
            "total": {"x-gdpr-sensitive": false},
        }))
        .unwrap();
        assert_eq!(s.sensitive_pointers(), vec!["/customer_name", "/tax_id"]);
    }

    #[test]
    fn json_schema_nested_and_arrays() {
        let s = Schema::from_value(&json!({
            "type": "object",
            "properties": {
                "customer": {"type": "object", "properties": {
                    "name": {"type": "string", "x-gdpr-sensitive": true},
                    "email": {"type": "string", "x-gdpr-sensitive": true,
                              "x-blind-index": {"normalize": ["trim", "lowercase"]}},
                    "country": {"type": "string"}
                }},
                "lines": {"type": "array", "items": {"properties": {
                    "note": {"x-gdpr-sensitive": true}
                }}},
                "address": {"type": "object", "x-gdpr-sensitive": true,
                            "properties": {"street": {"x-gdpr-sensitive": true}}}
            }
        }))
        .unwrap();
        assert_eq!(
            s.sensitive_pointers(),
            vec![
                "/address",
                "/customer/email",
                "/customer/name",
                "/lines/*/note"
            ]
        );
        assert_eq!(
            s.normalization("/customer/email"),
            Some(vec![Normalize::Trim, Normalize::Lowercase])
        );
        assert_eq!(s.normalization("/customer/name"), None);
    }

    #[test]
    fn unreachable_or_bad_markers_are_refused() {
        let e = Schema::from_value(&json!({"properties": {
            "a": {"allOf": [{"x-gdpr-sensitive": true}]}
        }}))
        .unwrap_err();
        assert!(e.to_string().contains("/properties/a/allOf/0"), "{e}");
        assert!(Schema::from_value(&json!({"a": {"x-gdpr-sensitive": "yes"}})).is_err());
        assert!(Schema::from_value(&json!({"a": true})).is_err());
        assert!(Schema::from_value(&json!([1])).is_err());
        assert!(
            Schema::from_value(&json!({"x-gdpr-sensitive": true, "properties": {"a": {}}}))
                .is_err()
        );
    }
}
