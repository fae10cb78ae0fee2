//! The environment under the command line: `RATELIMITD_<FLAG>` for every flag, then
//! envoyproxy/ratelimit's variables, each filling only what is still missing. Both become
//! `--flag=value` arguments, so a value from the environment meets the same parser, and the
//! same error, as one typed on the command line.

use clap::CommandFactory;

use super::envoyproxy;
use super::flags::Flags;

/// The command line with the environment's flags appended.
pub(super) struct Overlaid {
    /// Arguments for clap, program name first.
    pub(super) args: Vec<String>,
    /// envoyproxy/ratelimit variables that were set and are not honoured, one note each.
    pub(super) ignored: Vec<String>,
}

/// Appends to `args` (program name first) a `--flag=value` for every flag they lack that `env`
/// sets.
pub(super) fn overlay(
    mut args: Vec<String>,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Overlaid, clap::Error> {
    let on_command_line = |given: &[String], flag: &str| {
        given
            .iter()
            .any(|a| a == flag || a.starts_with(&format!("{flag}=")))
    };
    let cli: Vec<String> = args.clone();
    for arg in Flags::command().get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        let flag = format!("--{long}");
        if on_command_line(&cli, &flag) {
            continue;
        }
        let var = format!("RATELIMITD_{}", long.to_uppercase().replace('-', "_"));
        let Some(value) = env(&var) else { continue };
        if long == "config" {
            for part in value.split(',').filter(|p| !p.is_empty()) {
                args.push(format!("{flag}={part}"));
            }
        } else {
            args.push(format!("{flag}={value}"));
        }
    }
    // envoyproxy/ratelimit's variables fill whatever is still missing.
    let given: Vec<String> = args.clone();
    // A config source named natively: not a drop-in for envoyproxy/ratelimit's defaults.
    let dropin = !on_command_line(&given, "--config") && !on_command_line(&given, "--xds-server");
    let translated = envoyproxy::translate(&env, dropin).map_err(|message| {
        Flags::command().error(clap::error::ErrorKind::ValueValidation, message)
    })?;
    for (long, value) in translated.flags {
        let flag = format!("--{long}");
        if !on_command_line(&given, &flag) {
            args.push(format!("{flag}={value}"));
        }
    }
    Ok(Overlaid {
        args,
        ignored: translated.ignored,
    })
}
