//! Config errors that say where: file, line, column and field.

use std::fmt;
use std::path::{Path, PathBuf};

/// A config file that cannot be used, with its location.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The file at fault (or the config path, when it cannot be read at all).
    pub file: PathBuf,
    /// 1-based line, when known.
    pub line: Option<u64>,
    /// 1-based column, when known.
    pub column: Option<u64>,
    /// The field at fault, as a path like `descriptors[0].rate_limit.unit` (or `yaml` for a
    /// syntax error, `file` for I/O).
    pub field: String,
    /// What is wrong.
    pub message: String,
}

impl ConfigError {
    /// An error at a known place.
    pub fn at(
        file: &Path,
        location: Option<(u64, u64)>,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> ConfigError {
        ConfigError {
            file: file.to_owned(),
            line: location.map(|l| l.0),
            column: location.map(|l| l.1),
            field: field.into(),
            message: message.into(),
        }
    }

    /// A file that could not be read.
    pub fn io(file: &Path, err: &std::io::Error) -> ConfigError {
        ConfigError::at(file, None, "file", err.to_string())
    }

    /// Translates a deserializer error, keeping its location and naming the field it names.
    pub fn from_yaml(file: &Path, err: &serde_saphyr::Error) -> ConfigError {
        let location = err.location().map(|l| (l.line(), l.column()));
        let mut message = err.without_snippet().to_string();
        if message.contains("multiple YAML documents") {
            // The parser's own message names its API.
            message = "a config file holds one YAML document (one domain): split the documents \
                       separated by `---` into files"
                .into();
        }
        if let Some(at) = message.rfind(" at line ") {
            message.truncate(at);
        }
        // An unknown field is named; anything else (and an unknown field with an empty name)
        // is a YAML-level error.
        let field = message
            .strip_prefix("unknown field `")
            .and_then(|rest| rest.split('`').next())
            .filter(|name| !name.is_empty())
            .unwrap_or("yaml")
            .to_owned();
        ConfigError::at(file, location, field, message)
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
            if let Some(column) = self.column {
                write!(f, ":{column}")?;
            }
        }
        write!(f, ": {}: {}", self.field, self.message)
    }
}

impl std::error::Error for ConfigError {}
