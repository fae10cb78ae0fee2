//! Max-min fair shares of one pool's limit: the pure arithmetic, no clock, no I/O.

/// A participant's demand counts at least this fraction of an equal split, so that a new or
/// idle client (no demand seen yet) holds some quota and is never starved.
pub(crate) const FLOOR_OF_EQUAL_SPLIT: f64 = 0.25;
/// Demand is met with this much room above what was measured, so a client whose need grows a
/// little is not refused before its next report shows it.
pub(crate) const HEADROOM: f64 = 1.1;

/// Splits `capacity` (tokens per window) among clients whose demands (tokens per window; `None`
/// when not measured yet) are given, max-min fairly: a client asking less than an equal split
/// of what is left keeps what it asks (with `HEADROOM`); the rest is split equally among the
/// others. Every client asks at least the floor. What nobody asks for is split equally among all,
/// but nobody gets more of it than its own ask (`share_of`): a share is at most twice what
/// its client asks, and the rest of a pool far from its limit stays unheld, so that a client
/// that joins (an Envoy restarted while its predecessor's grant runs out) finds room at once.
pub fn fair_shares(capacity: f64, demands: &[Option<f64>]) -> Vec<f64> {
    let n = demands.len();
    if n == 0 {
        return Vec::new();
    }
    let capacity = capacity.max(0.0);
    let floor = capacity / n as f64 * FLOOR_OF_EQUAL_SPLIT;
    let asks: Vec<f64> = demands.iter().map(|d| ask(*d, capacity, floor)).collect();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| asks[a].total_cmp(&asks[b]));
    // Water-filling in ascending order: each client takes its ask while that is no more than
    // an equal split of what is left; the first one asking more sets the level, which every
    // client from there on gets (an equal split of what is left no longer changes). The same
    // steps, in the same order, as rlqs.lua's walk, so the two agree bit for bit.
    let mut left = capacity;
    let mut level = f64::INFINITY;
    for (k, &i) in order.iter().enumerate() {
        let equal = left / (n - k) as f64;
        if asks[i] > equal {
            level = equal;
            break;
        }
        left -= asks[i];
    }
    let extra = if level.is_infinite() && left > 0.0 {
        left / n as f64
    } else {
        0.0
    };
    asks.iter().map(|&a| share_of(a, level, extra)).collect()
}

/// A client's share from its ask and a split's terms (`level`: infinite when every ask was met;
/// `extra`: an equal split of what nobody asked for): its ask up to the level, and of the extra
/// at most as much again. Not the whole of the spare: a grant is held until its lease ends, and
/// the spare handed to a client that then dies would lock its successor out meanwhile (tried:
/// an Envoy restarted beside its predecessor's whole-pool grant admitted 3 of 387,027 requests).
/// The same arithmetic as rlqs.lua's `share_of`.
pub(crate) fn share_of(ask: f64, level: f64, extra: f64) -> f64 {
    let met = ask.min(level);
    met + extra.min(met)
}

/// What a client asking `demand` (tokens per window; `None` when not measured) counts for in a
/// split of `capacity` whose least ask is `least`: its demand with `HEADROOM`, bounded, so that
/// nobody asks more than the whole (a client's absurd report weighs no more than an honest
/// "everything") or less than the floor.
pub(crate) fn ask(demand: Option<f64>, capacity: f64, least: f64) -> f64 {
    match demand {
        Some(d) if d > 0.0 => (d * HEADROOM).min(capacity).max(least),
        _ => least,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn small_demands_are_met_and_the_rest_is_split_equally() {
        // 600 per minute among clients asking 60, 360 and 1200 per minute.
        let s = fair_shares(600.0, &[Some(60.0), Some(360.0), Some(1200.0)]);
        assert!(close(s[0], 66.0), "{s:?}");
        assert!(close(s[1], 267.0) && close(s[2], 267.0), "{s:?}");
        assert!(close(s.iter().sum(), 600.0));
    }

    #[test]
    fn unused_capacity_is_spread_over_everyone_up_to_their_own_ask() {
        let s = fair_shares(100.0, &[Some(20.0), Some(30.0)]);
        assert!(
            close(s[0], 22.0 + 22.0) && close(s[1], 33.0 + 22.5),
            "{s:?}"
        );
        // Far from the limit, a share is twice the ask (the floor here) and the rest is unheld:
        // a newcomer's floor fits beside it.
        let s = fair_shares(1e9, &[Some(130_000.0)]);
        assert!(close(s[0], 5e8), "{s:?}");
        let s = fair_shares(1e9, &[Some(130_000.0), None]);
        assert!(close(s[0], 2.5e8) && close(s[1], 2.5e8), "{s:?}");
    }

    #[test]
    fn new_and_idle_clients_keep_a_floor() {
        // Four clients, one busy: the three others keep a quarter of an equal split each.
        let s = fair_shares(400.0, &[Some(10_000.0), None, Some(0.0), None]);
        for &idle in &s[1..] {
            assert!(close(idle, 25.0), "{s:?}");
        }
        assert!(close(s[0], 325.0), "{s:?}");
    }

    #[test]
    fn absurd_demands_weigh_as_much_as_the_whole() {
        let honest = fair_shares(100.0, &[Some(100.0), Some(30.0)]);
        for absurd in [f64::INFINITY, 1e300, u64::MAX as f64] {
            assert_eq!(fair_shares(100.0, &[Some(absurd), Some(30.0)]), honest);
        }
        assert_eq!(
            fair_shares(100.0, &[Some(f64::NAN), Some(30.0)]),
            fair_shares(100.0, &[None, Some(30.0)])
        );
        assert!(fair_shares(0.0, &[Some(5.0)]).iter().all(|s| *s == 0.0));
    }
}
