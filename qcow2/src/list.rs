//! `qemu-img snapshot -l`'s table, column for column.

use crate::snapshot::Snapshot;

/// qemu's `size_to_str`: "0 B", "512 B", "1 KiB", "1.5 MiB".
pub fn size_to_str(v: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut i = 0;
    #[allow(clippy::cast_precision_loss)] // a display value
    let mut f = v as f64;
    while f >= 1024.0 * 0.95 && i + 1 < UNITS.len() {
        f /= 1024.0;
        i += 1;
    }
    if i == 0 {
        return format!("{v} B");
    }
    // %0.3g
    let s = if f >= 100.0 {
        format!("{f:.0}")
    } else if f >= 10.0 {
        format!("{f:.1}")
    } else {
        format!("{f:.2}")
    };
    let s = if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    };
    format!("{s} {}", UNITS[i])
}

fn local_date(sec: u32) -> String {
    let t = libc::time_t::from(sec);
    // SAFETY: an all-zero `tm` is a valid value for localtime_r to fill.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are to live locals for the call's duration.
    if unsafe { libc::localtime_r(&t, &mut tm) }.is_null() {
        return String::from("?");
    }
    format!(
        "{:04}-{:02}-{:02} {:02}:{:02}:{:02}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec
    )
}

fn row(cols: [&str; 6]) -> String {
    format!(
        "{:<7} {:<16} {:>8} {:>19} {:>15} {:>10}",
        cols[0], cols[1], cols[2], cols[3], cols[4], cols[5]
    )
}

/// The listing as `qemu-img snapshot -l` prints it (nothing at all when
/// there are no snapshots).
pub fn format(snaps: &[Snapshot]) -> String {
    if snaps.is_empty() {
        return String::new();
    }
    let mut out = String::from("Snapshot list:\n");
    out += &row(["ID", "TAG", "VM_SIZE", "DATE", "VM_CLOCK", "ICOUNT"]);
    out.push('\n');
    for s in snaps {
        let secs = s.vm_clock_nsec / 1_000_000_000;
        let clock = format!(
            "{:04}:{:02}:{:02}.{:03}",
            secs / 3600,
            (secs / 60) % 60,
            secs % 60,
            (s.vm_clock_nsec / 1_000_000) % 1000
        );
        let icount = if s.icount == u64::MAX {
            String::from("--")
        } else {
            s.icount.cast_signed().to_string()
        };
        out += &row([
            &s.id_str(),
            &s.name_str(),
            &size_to_str(s.vm_state_size),
            &local_date(s.date_sec),
            &clock,
            &icount,
        ]);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_like_qemus() {
        assert_eq!(size_to_str(0), "0 B");
        assert_eq!(size_to_str(512), "512 B");
        assert_eq!(size_to_str(1024), "1 KiB");
        assert_eq!(size_to_str(1536 * 1024), "1.5 MiB");
    }

    #[test]
    fn an_unrecorded_icount_prints_as_dashes() {
        let s = Snapshot {
            l1_table_offset: 0,
            l1_size: 0,
            id: b"1".to_vec(),
            name: b"a".to_vec(),
            date_sec: 0,
            date_nsec: 0,
            vm_clock_nsec: 3_723_004_000_000,
            vm_state_size: 0,
            disk_size: 0,
            icount: u64::MAX,
            extra_data_size: 24,
            unknown_extra: Vec::new(),
        };
        let out = format(&[s]);
        let row = out.lines().nth(2).expect("a row");
        assert!(row.ends_with("0001:02:03.004         --"), "{row:?}");
    }
}
