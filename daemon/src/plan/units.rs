//! Byte quantities as `sparkd plan` reads and prints them.
//!
//! Invariants: [`parse_bytes`] accepts a plain byte count or a number (decimals allowed) with a decimal
//! (`KB MB GB TB`, powers of 1000) or binary (`KiB MiB GiB TiB`, powers of 1024) unit, case-insensitive, with
//! or without a space; anything else (negative, zero, not finite, past `u64`) is an error naming the value.
//! [`gib`] prints GiB with two decimals; [`human`] picks GiB, MiB or KiB.

use super::PlanError;

/// The units `--gpu-memory` accepts, with their sizes in bytes.
const UNITS: [(&str, f64); 9] = [
    ("kib", 1024.0),
    ("mib", 1_048_576.0),
    ("gib", 1_073_741_824.0),
    ("tib", 1_099_511_627_776.0),
    ("kb", 1e3),
    ("mb", 1e6),
    ("gb", 1e9),
    ("tb", 1e12),
    ("b", 1.0),
];

/// Bytes from `141GB`, `139GiB`, `139.5 GiB` or `150000000000`.
pub fn parse_bytes(text: &str) -> Result<u64, PlanError> {
    let bad = |reason: &str| PlanError::Bytes { value: text.to_owned(), reason: reason.to_owned() };
    let trimmed = text.trim();
    let lower = trimmed.to_ascii_lowercase();
    let (number, scale) = UNITS
        .iter()
        .find_map(|(unit, scale)| lower.strip_suffix(unit).map(|n| (n.trim_end(), *scale)))
        .unwrap_or((lower.as_str(), 1.0));
    if number.is_empty() {
        return Err(bad("no number"));
    }
    if let Ok(bytes) = number.parse::<u64>() {
        let exact = bytes.checked_mul(scale as u64).filter(|_| scale.fract() == 0.0);
        return match exact {
            Some(0) => Err(bad("must be more than 0 bytes")),
            Some(b) => Ok(b),
            None => Err(bad("more bytes than 2^64")),
        };
    }
    let value: f64 = number.parse().map_err(|_| bad("not a number (e.g. 141GB, 139GiB or a byte count)"))?;
    let bytes = value * scale;
    if !bytes.is_finite() || bytes < 1.0 {
        return Err(bad("must be a finite size of at least 1 byte"));
    }
    if bytes >= u64::MAX as f64 {
        return Err(bad("more bytes than 2^64"));
    }
    Ok(bytes.round() as u64)
}

/// `bytes` in GiB with two decimals (`98.31 GiB`).
pub fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / 1_073_741_824.0)
}

/// `bytes` in the largest binary unit it has a whole one of (GiB, MiB, KiB), two decimals; bytes below 1 KiB.
pub fn human(bytes: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    match UNITS.iter().find(|(size, _)| bytes >= *size) {
        Some((size, unit)) => format!("{:.2} {unit}", bytes as f64 / *size as f64),
        None => format!("{bytes} B"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimal_and_binary_units_and_plain_counts() {
        assert_eq!(parse_bytes("141GB").unwrap(), 141_000_000_000);
        assert_eq!(parse_bytes("139GiB").unwrap(), 139 * (1 << 30));
        assert_eq!(parse_bytes("139 gib").unwrap(), 139 * (1 << 30));
        assert_eq!(parse_bytes("288GB").unwrap(), 288_000_000_000);
        assert_eq!(parse_bytes("1.5TiB").unwrap(), 3 * (1 << 39));
        assert_eq!(parse_bytes("150000000000").unwrap(), 150_000_000_000);
        assert_eq!(parse_bytes("512B").unwrap(), 512);
        assert_eq!(parse_bytes("0.5KiB").unwrap(), 512);
    }

    #[test]
    fn bad_sizes_name_the_value() {
        for bad in ["", "GB", "-1GB", "0", "0GiB", "lots", "1e400GB", "20000000000TB", "nanGB", "12XB"] {
            let e = parse_bytes(bad).unwrap_err();
            assert!(e.to_string().contains(&format!("`{bad}`")), "{bad}: {e}");
        }
    }

    #[test]
    fn gib_prints_two_decimals() {
        assert_eq!(gib(1 << 30), "1.00 GiB");
        assert_eq!(gib(139 * (1 << 30) + (1 << 29)), "139.50 GiB");
        assert_eq!(human(27 << 10), "27.00 KiB");
        assert_eq!(human(414 << 20), "414.00 MiB");
        assert_eq!(human(3 << 30), "3.00 GiB");
        assert_eq!(human(0), "0 B");
    }
}
