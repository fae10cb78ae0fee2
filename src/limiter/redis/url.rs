//! Redis URLs and credentials, parsed so that a password is never printed (`Debug`, `Display`
//! and errors show `***`) and reaches the Redis client byte for byte.

use std::fmt;

/// A Redis URL, parsed so that its user information can never be printed: `Debug` and
/// `Display` show `user:***`, and the password is only handed to the Redis client.
///
/// The user information is everything between `://` and the **last** `@` (a host, port or
/// database number never contains one), so a password with an unencoded `/`, `@`, `?` or `#`
/// is still recognised as a password, redacted, and percent-encoded before connecting.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisUrl {
    scheme: String,
    /// (user, password) as the credentials themselves (the URL's `%XX` escapes decoded),
    /// `None` when the URL has no `@`.
    pub(super) userinfo: Option<(String, Option<String>)>,
    /// host:port and anything after it (`/db`).
    rest: String,
}

/// Why a Redis URL was refused. Never carries the URL's password.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("expected redis://[user:pass@]host:port[/db] or rediss://…, got {shown}")]
pub struct UrlError {
    shown: String,
}

/// Percent-encodes `s` for the user information of a URL. `s` is the credential itself, so
/// every `%` is encoded too: a password `x%41y` reaches Redis as `x%41y`, never as `xAy`.
fn encode_userinfo(s: &str) -> String {
    encode(s, b"-._~!$&'()*+,;=")
}

/// Decodes the `%XX` escapes of a URL's user information into the credential they stand for.
/// A `%` not followed by two hex digits is kept as written; so is a result that is not UTF-8.
fn decode_userinfo(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
        match (
            bytes[i],
            bytes.get(i + 1).copied().and_then(hex),
            bytes.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(hi), Some(lo)) => {
                out.push(hi << 4 | lo);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).unwrap_or_else(|_| s.to_owned())
}

/// Percent-encodes `s` for a query parameter's value.
fn encode_query(s: &str) -> String {
    encode(s, b"-._~")
}

fn encode(s: &str, keep: &[u8]) -> String {
    let mut out = String::with_capacity(s.len());
    for &b in s.as_bytes() {
        if b.is_ascii_alphanumeric() || keep.contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl RedisUrl {
    /// Parses `redis://…` or `rediss://…`.
    pub fn parse(s: &str) -> Result<RedisUrl, UrlError> {
        let (scheme, after) = match s.split_once("://") {
            Some((scheme @ ("unix" | "redis+unix"), path)) if path.starts_with('/') => {
                // A Unix socket: a path, no user information.
                return Ok(RedisUrl {
                    scheme: scheme.to_owned(),
                    userinfo: None,
                    rest: path.to_owned(),
                });
            }
            Some((scheme @ ("redis" | "rediss"), after)) => (scheme, after),
            _ => {
                return Err(UrlError {
                    shown: if s.contains('@') {
                        "a value with user information (not shown)".into()
                    } else {
                        format!("'{s}'")
                    },
                });
            }
        };
        let (userinfo, rest) = match after.rfind('@') {
            Some(at) => {
                let (user, pass) = match after[..at].split_once(':') {
                    Some((u, p)) => (decode_userinfo(u), Some(decode_userinfo(p))),
                    None => (decode_userinfo(&after[..at]), None),
                };
                (Some((user, pass)), &after[at + 1..])
            }
            None => (None, after),
        };
        let url = RedisUrl {
            scheme: scheme.to_owned(),
            userinfo,
            rest: rest.to_owned(),
        };
        if rest.is_empty() || rest.starts_with(['/', ':']) {
            return Err(UrlError {
                shown: url.redacted(),
            });
        }
        Ok(url)
    }

    /// Whether the URL asks for TLS (`rediss://`).
    pub fn is_tls(&self) -> bool {
        self.scheme == "rediss"
    }

    /// The same URL over TLS (`rediss://`); a Unix socket stays as it is.
    pub fn with_tls(mut self) -> RedisUrl {
        if self.scheme == "redis" {
            self.scheme = "rediss".into();
        }
        self
    }

    /// Whether the URL carries a user or password.
    pub fn has_credentials(&self) -> bool {
        self.userinfo.is_some()
    }

    /// The same URL with `credentials` as its user information when it has none of its own.
    pub fn with_default_credentials(&self, credentials: &Credentials) -> RedisUrl {
        let mut url = self.clone();
        if url.userinfo.is_none() && credentials.password.is_some() {
            url.userinfo = Some((
                credentials.username.clone().unwrap_or_default(),
                credentials.password.clone(),
            ));
        }
        url
    }

    /// The URL with any password replaced by `***`: the only way it is ever shown.
    pub fn redacted(&self) -> String {
        match &self.userinfo {
            None => format!("{}://{}", self.scheme, self.rest),
            Some((user, None)) if user.is_empty() => format!("{}://{}", self.scheme, self.rest),
            Some((_, None)) => format!("{}://***@{}", self.scheme, self.rest),
            Some((user, Some(_))) => format!("{}://{user}:***@{}", self.scheme, self.rest),
        }
    }

    /// The URL as the Redis client reads it, user information percent-encoded (for a Unix
    /// socket, as the `user` and `pass` query parameters the client reads there).
    pub(super) fn for_client(&self) -> String {
        if self.scheme.ends_with("unix") {
            let mut s = format!("{}://{}", self.scheme, self.rest);
            if let Some((user, pass)) = &self.userinfo {
                let mut sep = if self.rest.contains('?') { '&' } else { '?' };
                if !user.is_empty() {
                    s.push_str(&format!("{sep}user={}", encode_query(user)));
                    sep = '&';
                }
                if let Some(p) = pass {
                    s.push_str(&format!("{sep}pass={}", encode_query(p)));
                }
            }
            return s;
        }
        match &self.userinfo {
            None => format!("{}://{}", self.scheme, self.rest),
            Some((user, pass)) => {
                let mut s = format!("{}://{}", self.scheme, encode_userinfo(user));
                if let Some(p) = pass {
                    s.push(':');
                    s.push_str(&encode_userinfo(p));
                }
                s.push('@');
                s.push_str(&self.rest);
                s
            }
        }
    }
}

impl fmt::Debug for RedisUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.redacted())
    }
}

impl fmt::Display for RedisUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

/// A user name and password given apart from a URL (`--redis-password`, or a Secret through
/// the environment). Never shown.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Credentials {
    /// ACL user; `None` for the default user.
    pub username: Option<String>,
    /// Password; `None` for no AUTH.
    pub password: Option<String>,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use redis::IntoConnectionInfo;

    use super::*;

    #[test]
    fn passwords_never_show() {
        let cases = [
            ("redis://:secret@host:6379/0", "redis://:***@host:6379/0"),
            (
                "redis://user:secret@host:6379",
                "redis://user:***@host:6379",
            ),
            ("rediss://token@host", "rediss://***@host"),
            ("redis://host:6379", "redis://host:6379"),
            ("redis://u:p@ss@host/1", "redis://u:***@host/1"),
            ("redis://:se/cret@host:6379", "redis://:***@host:6379"),
            (
                "redis://:se/cr@t?#x@host:6379/2",
                "redis://:***@host:6379/2",
            ),
            ("redis://u:a/b/secret@h", "redis://u:***@h"),
        ];
        for (url, shown) in cases {
            let u = RedisUrl::parse(url).unwrap();
            assert_eq!(u.to_string(), shown);
            assert!(!format!("{u:?}").contains("secret"), "{u:?}");
            assert!(!format!("{u:?}").contains("se/"), "{u:?}");
        }
        for bad in [
            "http://:secret@h",
            "host:6379",
            "redis://:secret@",
            "redis://",
        ] {
            let err = RedisUrl::parse(bad).unwrap_err().to_string();
            assert!(!err.contains("secret"), "{err}");
        }
    }

    #[test]
    fn unix_sockets_take_credentials_as_query_parameters() {
        let u = RedisUrl::parse("unix:///run/redis.sock")
            .unwrap()
            .with_default_credentials(&Credentials {
                username: None,
                password: Some("a&b=c".into()),
            })
            .with_tls();
        assert_eq!(u.to_string(), "unix://:***@/run/redis.sock");
        let info = u.for_client().into_connection_info().unwrap();
        assert_eq!(info.redis_settings().password(), Some("a&b=c"));
    }

    #[test]
    fn a_password_given_apart_from_a_url_reaches_redis_byte_for_byte() {
        let given = Credentials {
            username: Some("u%20".into()),
            password: Some("x%41y%".into()),
        };
        let u = RedisUrl::parse("redis://127.0.0.1:6379")
            .unwrap()
            .with_default_credentials(&given);
        let info = u.for_client().into_connection_info().unwrap();
        assert_eq!(info.redis_settings().password(), Some("x%41y%"));
        assert_eq!(info.redis_settings().username(), Some("u%20"));
        // Inside a URL, `%41` is an escape and stands for `A`.
        let u = RedisUrl::parse("redis://:x%41y@127.0.0.1:6379").unwrap();
        let info = u.for_client().into_connection_info().unwrap();
        assert_eq!(info.redis_settings().password(), Some("xAy"));
    }

    #[test]
    fn unencoded_passwords_reach_the_client_encoded() {
        let u = RedisUrl::parse("redis://us er:p/a@ss%2Fw?#@127.0.0.1:6379/3").unwrap();
        assert_eq!(
            u.for_client(),
            "redis://us%20er:p%2Fa%40ss%2Fw%3F%23@127.0.0.1:6379/3"
        );
        let info = u.for_client().into_connection_info().unwrap();
        assert_eq!(info.redis_settings().password(), Some("p/a@ss/w?#"));
        assert_eq!(info.redis_settings().username(), Some("us er"));
        assert_eq!(info.redis_settings().db(), 3);
    }
}
