//! Who is calling the admin listener: bearer tokens from `--admin-token-file`, one
//! `name:token` per line (blank lines and lines starting with `#` skipped), read again within
//! a second of the file changing. Only each token's SHA-256 is kept; a presented token is
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

/// The tokens `text` lists, or the first malformed line (its number and what is wrong).
fn parse(text: &str) -> Result<Vec<Token>, (usize, &'static str)> {
    let mut tokens = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((name, token)) = line.split_once(':') else {
            return Err((i + 1, "not name:token"));
        };
        let (name, token) = (name.trim(), token.trim());
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_graphic()) {
            return Err((i + 1, "the name is empty or not printable ASCII"));
        }
        if token.len() < MIN_TOKEN_BYTES || token.len() > MAX_TOKEN_BYTES {
            return Err((i + 1, "a token is 16 to 4,096 bytes"));
        }
        tokens.push(Token {
            name: name.into(),
            digest: digest(token.as_bytes()),
        });
    }
    Ok(tokens)
}

/// The tokens of `path`, or an error naming the file (and line).
fn read(path: &Path) -> Result<Vec<Token>, String> {
    let at = path.display();
    let meta = std::fs::metadata(path).map_err(|e| format!("{at}: {e}"))?;
    if meta.len() > MAX_FILE_BYTES {
        return Err(format!("{at}: larger than {MAX_FILE_BYTES} bytes"));
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("{at}: {e}"))?;
    let tokens = parse(&text).map_err(|(line, what)| format!("{at}:{line}: {what}"))?;
    if tokens.is_empty() {
        return Err(format!("{at}: no token (one name:token per line)"));
    }
    Ok(tokens)
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

    /// Reads the file again each second while it changes; a file that cannot be read or is
    /// malformed leaves the tokens before it in force (logged once per change).
    pub(crate) async fn keep(self: Arc<Self>) {
        let mut seen = std::fs::read(&self.file).ok();
        loop {
            tokio::time::sleep(RELOAD_EVERY).await;
            let now = std::fs::read(&self.file).ok();
            if now == seen {
                continue;
            }
            seen = now;
            match read(&self.file) {
                Ok(tokens) => {
                    tracing::info!(file = %self.file.display(), tokens = tokens.len(), "admin tokens reloaded");
                    self.tokens.store(Arc::new(tokens));
                }
                Err(e) => {
                    tracing::error!(error = %e, "admin tokens not reloaded; the ones before stay in force");
                }
            }
        }
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
                    .unwrap(),
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
    fn a_malformed_line_is_named() {
        assert_eq!(
            parse("a:0123456789abcdef\nno-colon\n").err(),
            Some((2, "not name:token"))
        );
        assert!(parse("a:short").is_err());
        assert!(parse(":0123456789abcdef").is_err());
    }
}
