//! A strict parser of the Prometheus text exposition format (0.0.4), for tests that check
//! `/metrics` the way a scraper reads it. Stricter than a scraper: every sample belongs to a
//! family announced by `# HELP` and `# TYPE` lines before it, families are contiguous,
//! metric and label names follow the format's grammar, label values use only its escapes, and
//! no series appears twice. (No crate on crates.io parses this strictly without pulling in a
//! date library; the format is small.)
use std::collections::{BTreeMap, BTreeSet};

/// One sample line.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// A metric family: its type, help and samples.
#[derive(Clone, Debug, PartialEq)]
pub struct Family {
    pub kind: String,
    pub help: String,
    pub samples: Vec<Sample>,
}

/// Families by name.
pub type Exposition = BTreeMap<String, Family>;

fn is_metric_name(s: &str) -> bool {
    let mut c = s.chars();
    c.next()
        .is_some_and(|f| f.is_ascii_alphabetic() || f == '_' || f == ':')
        && c.all(|x| x.is_ascii_alphanumeric() || x == '_' || x == ':')
}

fn is_label_name(s: &str) -> bool {
    let mut c = s.chars();
    c.next()
        .is_some_and(|f| f.is_ascii_alphabetic() || f == '_')
        && c.all(|x| x.is_ascii_alphanumeric() || x == '_')
}

fn parse_value(s: &str) -> Result<f64, String> {
    match s {
        "+Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => s.parse().map_err(|e| format!("bad value {s:?}: {e}")),
    }
}

/// Parses `{k="v",...}` at the start of `s`; returns the labels and the rest.
fn parse_labels(s: &str) -> Result<(BTreeMap<String, String>, &str), String> {
    let mut labels = BTreeMap::new();
    let mut rest = s.strip_prefix('{').ok_or("expected `{`")?;
    loop {
        if let Some(r) = rest.strip_prefix('}') {
            return Ok((labels, r));
        }
        let eq = rest.find('=').ok_or("label without `=`")?;
        let name = &rest[..eq];
        if !is_label_name(name) {
            return Err(format!("bad label name {name:?}"));
        }
        rest = rest[eq + 1..]
            .strip_prefix('"')
            .ok_or("label value not quoted")?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next() {
                None => return Err("unterminated label value".into()),
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, '\\')) => value.push('\\'),
                    Some((_, '"')) => value.push('"'),
                    Some((_, 'n')) => value.push('\n'),
                    other => return Err(format!("bad escape {other:?}")),
                },
                Some((_, '\n')) => return Err("newline in label value".into()),
                Some((_, c)) => value.push(c),
            }
        };
        if labels.insert(name.to_string(), value).is_some() {
            return Err(format!("label {name} twice"));
        }
        rest = &rest[end + 1..];
        if let Some(r) = rest.strip_prefix(',') {
            rest = r;
        } else if !rest.starts_with('}') {
            return Err("expected `,` or `}` after a label".into());
        }
    }
}

/// The family a sample name belongs to, given the families announced so far.
fn family_of<'a>(name: &'a str, fams: &Exposition) -> Option<&'a str> {
    if fams.contains_key(name) {
        return Some(name);
    }
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = name.strip_suffix(suffix) {
            if fams
                .get(base)
                .is_some_and(|f| f.kind == "histogram" || f.kind == "summary")
            {
                return Some(base);
            }
        }
    }
    None
}

/// Parses a whole exposition; the error names the line.
pub fn parse(text: &str) -> Result<Exposition, String> {
    let mut fams = Exposition::new();
    let mut helps: BTreeMap<String, String> = BTreeMap::new();
    let mut closed: BTreeSet<String> = BTreeSet::new();
    let mut current: Option<String> = None;
    let mut seen: BTreeSet<(String, Vec<(String, String)>)> = BTreeSet::new();
    for (n, line) in text.lines().enumerate() {
        let err = |m: String| format!("line {}: {m}: {line:?}", n + 1);
        if line.trim().is_empty() {
            continue;
        }
        if let Some(c) = line.strip_prefix("# ") {
            let mut parts = c.splitn(3, ' ');
            let (kw, name, rest) = (parts.next(), parts.next(), parts.next().unwrap_or(""));
            let name = name.ok_or_else(|| err("comment without a name".into()))?;
            match kw {
                Some("HELP") => {
                    if !is_metric_name(name) {
                        return Err(err("bad metric name".into()));
                    }
                    if helps.insert(name.to_string(), rest.to_string()).is_some() {
                        return Err(err("second HELP".into()));
                    }
                }
                Some("TYPE") => {
                    if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&rest) {
                        return Err(err(format!("unknown type {rest:?}")));
                    }
                    if fams.contains_key(name) || closed.contains(name) {
                        return Err(err("second TYPE".into()));
                    }
                    let help = helps
                        .get(name)
                        .cloned()
                        .ok_or_else(|| err("TYPE without HELP before it".into()))?;
                    if let Some(c) = current.replace(name.to_string()) {
                        closed.insert(c);
                    }
                    fams.insert(
                        name.to_string(),
                        Family {
                            kind: rest.to_string(),
                            help,
                            samples: Vec::new(),
                        },
                    );
                }
                _ => {}
            }
            continue;
        }
        let name_end = line
            .find(['{', ' '])
            .ok_or_else(|| err("sample without value".into()))?;
        let name = &line[..name_end];
        if !is_metric_name(name) {
            return Err(err("bad metric name".into()));
        }
        let (labels, rest) = if line[name_end..].starts_with('{') {
            parse_labels(&line[name_end..]).map_err(err)?
        } else {
            (BTreeMap::new(), &line[name_end..])
        };
        let mut fields = rest
            .strip_prefix(' ')
            .ok_or_else(|| err("no space before value".into()))?
            .split(' ');
        let value = parse_value(fields.next().unwrap_or("")).map_err(err)?;
        if let Some(ts) = fields.next() {
            ts.parse::<i64>()
                .map_err(|e| err(format!("bad timestamp: {e}")))?;
        }
        if fields.next().is_some() {
            return Err(err("trailing fields".into()));
        }
        let fam = family_of(name, &fams)
            .ok_or_else(|| err("sample of no announced family".into()))?
            .to_string();
        if current.as_deref() != Some(fam.as_str()) {
            return Err(err(format!("sample of family {fam} outside its block")));
        }
        let key = (
            name.to_string(),
            labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        );
        if !seen.insert(key) {
            return Err(err("duplicate series".into()));
        }
        if let Some(f) = fams.get_mut(&fam) {
            f.samples.push(Sample {
                name: name.to_string(),
                labels,
                value,
            });
        }
    }
    Ok(fams)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_labels_escapes_and_histograms() {
        let t = "# HELP a:b x\n# TYPE a:b gauge\na:b{k=\"v\\\"1\\n\",j=\"\"} 2.5\n\
                 # HELP h y\n# TYPE h histogram\nh_bucket{le=\"+Inf\"} 3\nh_sum 1\nh_count 3\n";
        let e = parse(t).unwrap();
        let s = &e["a:b"].samples[0];
        assert_eq!(s.labels["k"], "v\"1\n");
        assert_eq!(s.labels["j"], "");
        assert_eq!(s.value, 2.5);
        assert_eq!(e["h"].samples.len(), 3);
    }

    #[test]
    fn rejects_what_a_scraper_would_not_accept() {
        for bad in [
            "x 1\n",                                                         // no family
            "# TYPE x gauge\nx 1\n",                                         // no HELP
            "# HELP x h\n# TYPE x gauge\nx{a=1} 1\n",                        // unquoted
            "# HELP x h\n# TYPE x gauge\nx 1\nx 2\n",                        // duplicate series
            "# HELP x h\n# TYPE x gauge\nx{a=\"\\t\"} 1\n",                  // bad escape
            "# HELP x h\n# TYPE x gauge\n# HELP y h\n# TYPE y gauge\nx 1\n", // split family
            "# HELP x h\n# TYPE x gauge\nx one\n",                           // bad value
        ] {
            assert!(parse(bad).is_err(), "accepted {bad:?}");
        }
    }
}
