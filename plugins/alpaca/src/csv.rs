//! A small RFC 4180 reader: comma-separated fields, double-quoted fields may hold commas, quotes (doubled) and line
//! breaks; `\n` or `\r\n` end a record.

/// Parses `text` into records of fields; the error names the line of an unterminated quote.
pub(crate) fn parse(text: &str) -> Result<Vec<Vec<String>>, String> {
    let mut rows = Vec::new();
    let mut row = Vec::new();
    let mut field = String::new();
    let mut chars = text.chars().peekable();
    let (mut line, mut quote_line) = (1usize, 0usize);
    let mut in_quotes = false;
    let mut row_has_data = false;
    while let Some(c) = chars.next() {
        if in_quotes {
            match c {
                '"' if chars.peek() == Some(&'"') => {
                    chars.next();
                    field.push('"');
                }
                '"' => in_quotes = false,
                c => {
                    if c == '\n' {
                        line += 1;
                    }
                    field.push(c);
                }
            }
            continue;
        }
        match c {
            '"' => {
                in_quotes = true;
                quote_line = line;
                row_has_data = true;
            }
            ',' => {
                row.push(std::mem::take(&mut field));
                row_has_data = true;
            }
            '\r' if chars.peek() == Some(&'\n') => {}
            '\n' => {
                line += 1;
                if row_has_data || !field.is_empty() {
                    row.push(std::mem::take(&mut field));
                    rows.push(std::mem::take(&mut row));
                }
                row_has_data = false;
            }
            c => {
                field.push(c);
                row_has_data = true;
            }
        }
    }
    if in_quotes {
        return Err(format!(
            "quoted field opened on line {quote_line} is never closed"
        ));
    }
    if row_has_data || !field.is_empty() {
        row.push(field);
        rows.push(row);
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn quotes_commas_and_line_breaks() {
        let rows = parse("a,b\r\n\"x, \"\"y\"\"\",\"two\nlines\"\nlast,").unwrap();
        assert_eq!(
            rows,
            vec![
                vec!["a", "b"],
                vec!["x, \"y\"", "two\nlines"],
                vec!["last", ""]
            ]
        );
    }

    #[test]
    fn unterminated_quote_names_its_line() {
        assert!(parse("a\n\"b,c\n").unwrap_err().contains("line 2"));
    }
}
