//! Refcount block entries of every width the format allows (1 to 64 bits).
//!
//! Widths below 8 bits pack entries from the least significant bit of each
//! byte up; 8 bits and wider are big-endian, as qemu stores them.

/// A byte with the low `bits` (1, 2 or 4) bits set.
fn low_bits(bits: usize) -> u8 {
    0xffu8 >> (8 - bits)
}

/// Entry `i` of a refcount block with entries of `1 << order` bits.
/// `block` must hold entry `i` (callers index within one cluster).
pub fn get(block: &[u8], order: u32, i: u64) -> u64 {
    #[allow(clippy::cast_possible_truncation)] // i < block bits, a usize
    let i = i as usize;
    match order {
        0..=2 => {
            let bits = 1usize << order;
            let per = 8 / bits;
            let byte = block[i / per];
            u64::from((byte >> ((i % per) * bits)) & low_bits(bits))
        }
        _ => {
            let bytes = 1usize << (order - 3);
            let mut v = 0u64;
            for b in &block[i * bytes..(i + 1) * bytes] {
                v = (v << 8) | u64::from(*b);
            }
            v
        }
    }
}

/// Set entry `i`; `value` must fit in the width.
pub fn set(block: &mut [u8], order: u32, i: u64, value: u64) {
    #[allow(clippy::cast_possible_truncation)] // i < block bits, a usize
    let i = i as usize;
    match order {
        0..=2 => {
            let bits = 1usize << order;
            let per = 8 / bits;
            let shift = (i % per) * bits;
            let mask = low_bits(bits) << shift;
            #[allow(clippy::cast_possible_truncation)] // value < 2^bits
            let v = ((value as u8) << shift) & mask;
            block[i / per] = (block[i / per] & !mask) | v;
        }
        _ => {
            let bytes = 1usize << (order - 3);
            let be = value.to_be_bytes();
            block[i * bytes..(i + 1) * bytes].copy_from_slice(&be[8 - bytes..]);
        }
    }
}

/// The largest refcount of the width.
pub fn max(order: u32) -> u64 {
    if order >= 6 {
        u64::MAX
    } else {
        (1u64 << (1 << order)) - 1
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn one_bit_entries_fill_bytes_from_the_low_bit() {
        let mut b = [0u8; 2];
        set(&mut b, 0, 0, 1);
        set(&mut b, 0, 9, 1);
        assert_eq!(b, [0b0000_0001, 0b0000_0010]);
    }

    #[test]
    fn sixteen_bit_entries_are_big_endian() {
        let mut b = [0u8; 4];
        set(&mut b, 4, 1, 0x0102);
        assert_eq!(b, [0, 0, 1, 2]);
    }

    proptest! {
        #[test]
        fn set_then_get_round_trips_and_leaves_neighbours(order in 0u32..=6, i in 0u64..64, v in any::<u64>(), fill in any::<u8>()) {
            let mut b = vec![fill; 512];
            let before = b.clone();
            let v = v & max(order);
            set(&mut b, order, i, v);
            prop_assert_eq!(get(&b, order, i), v);
            for j in 0..64u64 {
                if j != i {
                    prop_assert_eq!(get(&b, order, j), get(&before, order, j));
                }
            }
        }
    }
}
