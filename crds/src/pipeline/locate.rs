//! Finds the line a field is on, so that errors found after parsing (a value
//! that is well-formed but wrong) can still point at the line.
//!
//! serde_yaml reports lines only for its own errors, so this walks the text
//! by indentation. It is best-effort: a pipeline written in flow style
//! (`{a: 1}`) gets the line of the nearest enclosing block field.

/// The 1-based line of `path` (e.g. `checkpoint.interval`, `steps[2].filter`).
pub fn line_of(text: &str, path: &str) -> Option<usize> {
    let lines: Vec<&str> = text.lines().collect();
    let mut start = 0usize; // first line to search
    let mut end = lines.len(); // one past the last line to search
    let mut parent_indent: isize = -1;
    let mut found = None;
    for segment in segments(path) {
        let hit = match segment {
            Segment::Key(key) => find_key(&lines[start..end], key, parent_indent),
            Segment::Index(i) => find_item(&lines[start..end], i, parent_indent),
        };
        let (offset, indent) = match hit {
            Some(h) => h,
            None => return found,
        };
        let line = start + offset;
        found = Some(line + 1);
        // The children of this node are the following lines indented deeper.
        let mut child_end = line + 1;
        while child_end < end {
            let l = lines[child_end];
            if !l.trim().is_empty() && !l.trim_start().starts_with('#') && (indent_of(l) as isize) <= indent {
                break;
            }
            child_end += 1;
        }
        start = line;
        end = child_end;
        parent_indent = indent;
    }
    found
}

enum Segment<'a> {
    Key(&'a str),
    Index(usize),
}

fn segments(path: &str) -> Vec<Segment<'_>> {
    let mut out = Vec::new();
    for part in path.split('.') {
        let (name, rest) = match part.find('[') {
            Some(i) => (&part[..i], &part[i..]),
            None => (part, ""),
        };
        if !name.is_empty() {
            out.push(Segment::Key(name));
        }
        for idx in rest.split('[').filter(|s| !s.is_empty()) {
            if let Ok(i) = idx.trim_end_matches(']').parse() {
                out.push(Segment::Index(i));
            }
        }
    }
    out
}

fn indent_of(line: &str) -> usize {
    line.len() - line.trim_start().len()
}

/// A key on a line, either at the start or after a list dash (`- key:`).
/// Returns (line offset, indentation of the key itself).
fn find_key(lines: &[&str], key: &str, parent_indent: isize) -> Option<(usize, isize)> {
    for (i, line) in lines.iter().enumerate() {
        let mut indent = indent_of(line);
        let mut body = line.trim_start();
        if let Some(after_dash) = body.strip_prefix("- ") {
            indent += 2 + (after_dash.len() - after_dash.trim_start().len());
            body = after_dash.trim_start();
        }
        if (indent as isize) <= parent_indent && i > 0 {
            continue;
        }
        if let Some(rest) = body.strip_prefix(key) {
            if rest.trim_start().starts_with(':') {
                return Some((i, indent as isize));
            }
        }
    }
    None
}

/// The `n`th list item (0-based) among the lines. Returns (line offset, indentation of the item's content).
fn find_item(lines: &[&str], n: usize, parent_indent: isize) -> Option<(usize, isize)> {
    let mut seen = 0;
    let mut item_indent: Option<usize> = None;
    for (i, line) in lines.iter().enumerate() {
        let body = line.trim_start();
        if !(body.starts_with("- ") || body == "-") {
            continue;
        }
        let indent = indent_of(line);
        if (indent as isize) < parent_indent {
            continue;
        }
        match item_indent {
            None => item_indent = Some(indent),
            Some(d) if d != indent => continue,
            _ => {}
        }
        if seen == n {
            return Some((i, indent as isize + 1));
        }
        seen += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::line_of;

    const TEXT: &str = "name: x\nparallelism: 4\ncheckpoint:\n  interval: 500ms\nsource:\n  generator:\n    events: 10\nsteps:\n  - key_by: key\n  - running_count: count\n  - filter: \"x > 1\"\nsink:\n  stdout: {}\n";

    #[test]
    fn finds_top_level_and_nested_fields() {
        assert_eq!(line_of(TEXT, "parallelism"), Some(2));
        assert_eq!(line_of(TEXT, "checkpoint.interval"), Some(4));
        assert_eq!(line_of(TEXT, "source.generator.events"), Some(7));
    }

    #[test]
    fn finds_list_items_by_index() {
        assert_eq!(line_of(TEXT, "steps[0]"), Some(9));
        assert_eq!(line_of(TEXT, "steps[2].filter"), Some(11));
    }

    #[test]
    fn falls_back_to_the_nearest_parent() {
        assert_eq!(line_of(TEXT, "sink.stdout.nothing"), Some(13));
    }
}
