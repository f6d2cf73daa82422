//! How figures read in the report and the goals: about three significant
//! digits, and tiny ratios as `1/N`.

/// A figure with about three significant digits.
pub fn fmt_num(x: f64) -> String {
    if !x.is_finite() {
        return "n/a".into();
    }
    let a = x.abs();
    if a >= 100.0 {
        format!("{x:.0}")
    } else if a >= 10.0 {
        format!("{x:.1}")
    } else if a >= 0.1 || a == 0.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.3}")
    }
}

/// A ratio; tiny ones as `1/N` so the factor is readable.
pub fn fmt_ratio(r: Option<f64>) -> String {
    match r {
        None => "—".into(),
        Some(r) if r > 0.0 && r < 0.01 => format!("1/{:.0}", 1.0 / r),
        Some(r) => format!("{r:.2}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_ratios_read_as_factors() {
        assert_eq!(fmt_ratio(Some(0.001)), "1/1000");
        assert_eq!(fmt_ratio(Some(1.234)), "1.23");
        assert_eq!(fmt_ratio(None), "—");
    }

    #[test]
    fn figures_keep_about_three_digits() {
        assert_eq!(fmt_num(1234.4), "1234");
        assert_eq!(fmt_num(12.34), "12.3");
        assert_eq!(fmt_num(0.1234), "0.12");
        assert_eq!(fmt_num(0.01234), "0.012");
        assert_eq!(fmt_num(f64::NAN), "n/a");
    }
}
