//! Who is calling the admin listener: bearer tokens from `--admin-token-file`, one
//! `name:token` per line (blank lines and lines starting with `#` skipped; only lines that end
//! in a newline count), read again within a second of the file changing, and then taken as it
//! is: no token of an earlier version outlives it (fail closed). Only each token's SHA-256 is kept; a presented token is
//! hashed and compared with every one kept, each comparison in constant time and none cut
//! short, so the answer's timing says nothing of which bytes matched. A token is never
//! logged; its name is, with every change it makes.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;

/// How often the token file is read again.
const RELOAD_EVERY: Duration = Duration::from_secs(1);
/// Most bytes of a token file, and of one presented token.
const MAX_FILE_BYTES: u64 = 1 << 20;
const MAX_TOKEN_BYTES: usize = 4096;
/// Fewest bytes of a token: shorter ones are guessable.
const MIN_TOKEN_BYTES: usize = 16;

/// One token, as kept.
struct Token {
    name: Arc<str>,
    digest: [u8; 32],
}

/// The tokens in force and the file they come from.
pub(crate) struct Tokens {
    file: PathBuf,
    tokens: ArcSwap<Vec<Token>>,
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, bytes);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// What a token file says: the token of each whole, well-formed line, and what is wrong with
/// each other line that is not blank or a comment (its number and what).
struct Parsed {
    tokens: Vec<Token>,
    wrong: Vec<(usize, &'static str)>,
}

/// Reads `text` line by line. Only a line that ends in a newline counts: a file being written
/// (an editor's save, a `>>` append) may end in part of a line, and a part of a token is
/// never one.
fn parse(text: &str) -> Parsed {
    let mut parsed = Parsed {
        tokens: Vec::new(),
        wrong: Vec::new(),
    };
    for (i, whole) in text.split_inclusive('\n').enumerate() {
        let line = whole.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut wrong = |what| parsed.wrong.push((i + 1, what));
        if !whole.ends_with('\n') {
            wrong("no newline at its end (a line still being written is never a token)");
            continue;
        }
        let Some((name, token)) = line.split_once(':') else {
            wrong("not name:token");
            continue;
        };
        let (name, token) = (name.trim(), token.trim());
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_graphic()) {
            wrong("the name is empty or not printable ASCII");
        } else if token.len() < MIN_TOKEN_BYTES || token.len() > MAX_TOKEN_BYTES {
            wrong("a token is 16 to 4,096 bytes");
        } else {
            parsed.tokens.push(Token {
                name: name.into(),
                digest: digest(token.as_bytes()),
            });
        }
    }
    parsed
}

/// What `path` says now, or why it cannot be read.
fn read_parsed(path: &Path) -> Result<Parsed, String> {
    let at = path.display();
    let meta = std::fs::metadata(path).map_err(|e| format!("{at}: {e}"))?;
    if meta.len() > MAX_FILE_BYTES {
        return Err(format!("{at}: larger than {MAX_FILE_BYTES} bytes"));
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("{at}: {e}"))?;
    Ok(parse(&text))
}

/// The tokens of `path` at start: an error naming the file (and line) unless every line is
/// whole and well formed and there is at least one token.
fn read(path: &Path) -> Result<Vec<Token>, String> {
    let at = path.display();
    let parsed = read_parsed(path)?;
    if let Some((line, what)) = parsed.wrong.first() {
        return Err(format!("{at}:{line}: {what}"));
    }
    if parsed.tokens.is_empty() {
        return Err(format!("{at}: no token (one name:token per line)"));
    }
    Ok(parsed.tokens)
}

/// Checks `path` as the listener would read it at start (for the settings' check).
pub(crate) fn check_file(path: &Path) -> Result<(), String> {
    read(path).map(|_| ())
}

impl Tokens {
    /// The tokens of `file`, read now.
    pub(crate) fn load(file: &Path) -> Result<Arc<Tokens>, String> {
        Ok(Arc::new(Tokens {
            file: file.to_owned(),
            tokens: ArcSwap::from_pointee(read(file)?),
        }))
    }

    /// The name of the token `authorization` (an `Authorization` header's value) bears, or
    /// `None`: no header, not `Bearer`, or no token in force matches.
    pub(crate) fn caller(&self, authorization: Option<&[u8]>) -> Option<Arc<str>> {
        let value = authorization?;
        // The scheme is case-insensitive (RFC 9110, 11.1), then one or more spaces.
        let space = value.iter().position(|b| *b == b' ')?;
        let (scheme, token) = value.split_at(space);
        if !scheme.eq_ignore_ascii_case(b"Bearer") {
            return None;
        }
        let token = token.trim_ascii_start();
        if token.is_empty() || token.len() > MAX_TOKEN_BYTES {
            return None;
        }
        let presented = digest(token);
        let mut found = None;
        for t in self.tokens.load().iter() {
            // Every byte of every digest compared, whatever matched before.
            let differ = t
                .digest
                .iter()
                .zip(&presented)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b));
            if differ == 0 && found.is_none() {
                found = Some(t.name.clone());
            }
        }
        found
    }

    /// Reads the file again each second while it changes, and takes what it says then: the
    /// tokens of its whole, well-formed lines, nothing kept from before. A malformed line is
    /// logged and accepts no one; a file with no token, or one that cannot be read (deleted,
    /// unreadable, too large), accepts no token at all until it names some again: a revoked
    /// token never outlives its removal by more than the interval, whatever the file's state.
    pub(crate) async fn keep(self: Arc<Self>) {
        let mut seen = std::fs::read(&self.file).ok();
        loop {
            tokio::time::sleep(RELOAD_EVERY).await;
            let now = std::fs::read(&self.file).ok();
            if now == seen {
                continue;
            }
            seen = now;
            self.reload();
        }
    }

    /// Takes the file as it is now (see [`Tokens::keep`]).
    fn reload(&self) {
        let file = self.file.display();
        let tokens = match read_parsed(&self.file) {
            Ok(parsed) => {
                for (line, what) in &parsed.wrong {
                    tracing::error!(file = %file, line, what, "admin token file: a line is not a token");
                }
                parsed.tokens
            }
            Err(e) => {
                tracing::error!(error = %e, "admin token file unreadable: no token is accepted until it can be read");
                Vec::new()
            }
        };
        match tokens.len() {
            0 => {
                tracing::error!(file = %file, "admin token file names no token: every admin call is refused (401)")
            }
            n => tracing::info!(file = %file, tokens = n, "admin tokens reloaded"),
        }
        self.tokens.store(Arc::new(tokens));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_names_its_caller_and_nothing_else_does() {
        let tokens = Tokens {
            file: PathBuf::new(),
            tokens: ArcSwap::from_pointee(
                parse("# operators\nalice:0123456789abcdef0123\n\nbob : fedcba9876543210fedc\n")
                    .tokens,
            ),
        };
        let who = |h: &str| tokens.caller(Some(h.as_bytes())).map(|n| n.to_string());
        assert_eq!(who("Bearer 0123456789abcdef0123").as_deref(), Some("alice"));
        for scheme in ["bearer", "BEARER", "bEaReR"] {
            let header = format!("{scheme}  0123456789abcdef0123");
            assert_eq!(who(&header).as_deref(), Some("alice"), "{header}");
        }
        assert_eq!(who("Basic 0123456789abcdef0123"), None);
        assert_eq!(who("Bearer0123456789abcdef0123"), None);
        assert_eq!(who("Bearer fedcba9876543210fedc").as_deref(), Some("bob"));
        assert_eq!(who("Bearer 0123456789abcdef012"), None);
        assert_eq!(who("Basic 0123456789abcdef0123"), None);
        assert_eq!(who("Bearer "), None);
        assert_eq!(tokens.caller(None), None);
    }

    #[test]
    fn a_malformed_line_is_named_and_no_token() {
        let p = parse("a:0123456789abcdef\nno-colon\nb:0123456789abcdef\n");
        assert_eq!(p.wrong, [(2, "not name:token")]);
        assert_eq!(
            p.tokens.len(),
            2,
            "the whole, well-formed lines still count"
        );
        assert_eq!(parse("a:short\n").wrong.len(), 1);
        assert_eq!(parse(":0123456789abcdef\n").wrong.len(), 1);
        // A last line without its newline is being written: never a token.
        let partial = parse("a:0123456789abcdef\nb:0123456789abcdef01");
        assert_eq!(partial.tokens.len(), 1);
        assert_eq!(partial.wrong[0].0, 2);
        let comments = parse("# none yet\n\n   \n# x");
        assert!(comments.tokens.is_empty() && comments.wrong.is_empty());
    }
}
