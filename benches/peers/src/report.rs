//! Summaries over rounds, the table, the JSON lines, and the words about the run's machine.

use crate::work::Figures;

/// One figure over the rounds of a cell.
#[derive(Clone, Debug, PartialEq)]
pub struct Spread {
    pub key: &'static str,
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

/// Per key (in the first round's order), the median, minimum and maximum over `rounds`. The
/// median of an even number of rounds is the mean of the middle two.
pub fn summarise(rounds: &[Figures]) -> Vec<Spread> {
    let Some(first) = rounds.first() else { return Vec::new() };
    first
        .iter()
        .map(|(key, _)| {
            let mut v: Vec<f64> =
                rounds.iter().filter_map(|f| f.iter().find(|(k, _)| k == key).map(|(_, x)| *x)).collect();
            v.sort_by(f64::total_cmp);
            let n = v.len();
            let median = if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 };
            Spread { key, median, min: v[0], max: v[n - 1] }
        })
        .collect()
}

/// Whether a smaller value of `key` is better (latencies) or a larger one (rates).
pub fn lower_is_better(key: &str) -> bool {
    key.ends_with("_us")
}

/// "3.1× faster" or "1.4× slower": tensorshare against a peer, from ts/peer of `key`.
pub fn verdict(key: &str, ts_over_peer: f64) -> String {
    let faster = if lower_is_better(key) { 1.0 / ts_over_peer } else { ts_over_peer };
    if !faster.is_finite() {
        "-".into()
    } else if faster >= 1.0 {
        format!("{} faster", factor(faster))
    } else {
        format!("{} slower", factor(1.0 / faster))
    }
}

fn factor(x: f64) -> String {
    if x >= 10.0 {
        format!("{x:.0}×")
    } else {
        format!("{x:.1}×")
    }
}

/// A figure for the table: few digits, thousands grouped.
pub fn num(v: f64) -> String {
    if v >= 10_000.0 {
        group(v.round() as u64)
    } else if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else if v >= 0.1 {
        format!("{v:.2}")
    } else {
        format!("{v:.4}")
    }
}

fn group(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A JSON string literal.
pub fn quote(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out + "\""
}

/// Today's date (UTC) as YYYY-MM-DD, from the system clock.
pub fn today() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (y, m, d) = civil_from_days((secs / 86_400) as i64);
    format!("{y:04}-{m:02}-{d:02}")
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (H. Hinnant's method).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = (if mp < 10 { mp + 3 } else { mp - 9 }) as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// The machine in one line: CPU model, CPUs, memory, kernel.
pub fn machine() -> String {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpuinfo = read("/proc/cpuinfo");
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split_once(':')).map(|(_, m)| m.trim()))
        .unwrap_or("unknown CPU");
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem_gib = read("/proc/meminfo")
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|r| r.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0 / 1024.0);
    let kernel = read("/proc/sys/kernel/osrelease");
    format!("{model}, {cpus} CPUs, {mem_gib:.0} GiB, Linux {}", kernel.trim())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summaries_give_the_median_and_the_range() {
        let rounds = vec![
            vec![("median_us", 9.0), ("p99_us", 30.0)],
            vec![("median_us", 7.0), ("p99_us", 60.0)],
            vec![("median_us", 60.0), ("p99_us", 31.0)],
            vec![("median_us", 8.0), ("p99_us", 29.0)],
        ];
        let s = summarise(&rounds);
        assert_eq!(s[0], Spread { key: "median_us", median: 8.5, min: 7.0, max: 60.0 });
        assert_eq!(s[1], Spread { key: "p99_us", median: 30.5, min: 29.0, max: 60.0 });
        assert!(summarise(&[]).is_empty());
    }

    #[test]
    fn verdicts_read_the_right_way_round() {
        assert_eq!(verdict("median_us", 0.5), "2.0× faster");
        assert_eq!(verdict("median_us", 4.0), "4.0× slower");
        assert_eq!(verdict("GBps", 20.0), "20× faster");
        assert_eq!(verdict("tensors_per_s", 0.5), "2.0× slower");
    }

    #[test]
    fn numbers_and_dates_print_plainly() {
        assert_eq!(
            (num(1_234_567.0), num(123.4), num(12.34), num(1.234)),
            ("1,234,567".into(), "123".into(), "12.3".into(), "1.23".into())
        );
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_000), (2024, 10, 4));
        assert_eq!(quote("a\"b\\"), "\"a\\\"b\\\\\"");
    }
}
