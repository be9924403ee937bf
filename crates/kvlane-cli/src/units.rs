//! Parsing of sizes (`4K`, `1M`) and durations (`2s`, `500ms`).

use std::time::Duration;

/// Parses `4096`, `4K`, `4KiB`, `64k`, `1M`, `16MiB`, `1G` (binary units).
pub(crate) fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size (try 4K, 64K, 1M)"))?;
    let mult = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => {
            return Err(format!(
                "`{s}` has an unknown unit `{unit}` (use K, M or G)"
            ))
        }
    };
    n.checked_mul(mult)
        .filter(|&v| v > 0)
        .ok_or_else(|| format!("`{s}` is zero or too large"))
}

/// The largest region, and so the largest size a flag may ask for: no
/// allocation is longer than `isize::MAX` bytes.
pub(crate) const MAX_REGION_SIZE: u64 = isize::MAX as u64;

/// Refuses a size `flag` asks for that no region can hold, with one line
/// that names the flag and the value.
pub(crate) fn check_region_size(flag: &str, n: u64) -> Result<u64, String> {
    if n > MAX_REGION_SIZE {
        return Err(format!(
            "{flag} {n}: too large; a region holds at most {MAX_REGION_SIZE} bytes"
        ));
    }
    Ok(n)
}

/// Parses `2`, `2s`, `1.5s`, `500ms`.
pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let (num, scale) = if let Some(n) = t.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1.0)
    } else {
        (t, 1.0)
    };
    let v: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a duration (try 2s or 500ms)"))?;
    if !(v.is_finite() && v > 0.0) {
        return Err(format!("`{s}` must be a positive duration"));
    }
    Ok(Duration::from_secs_f64(v * scale))
}

/// Formats a byte count with a binary unit (`64K`, `1M`).
pub(crate) fn fmt_size(n: u64) -> String {
    match n {
        n if n >= 1 << 30 && n % (1 << 30) == 0 => format!("{}G", n >> 30),
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{}M", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{}K", n >> 10),
        n => format!("{n}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("64KiB"), Ok(65536));
        assert_eq!(parse_size("16m"), Ok(16 << 20));
        assert_eq!(parse_size("100"), Ok(100));
        assert!(parse_size("0").is_err());
        assert!(parse_size("4X").unwrap_err().contains("unknown unit"));
        assert!(parse_size("K").is_err());
        assert_eq!(fmt_size(65536), "64K");
        assert_eq!(fmt_size(1000), "1000");
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("abc").is_err());
    }
}
