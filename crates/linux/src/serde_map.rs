//! Serializing `imbl::OrdMap` as a plain sequence of pairs. imbl's own map
//! deserializer preallocates whatever count the input claims, so a crafted
//! state file could abort the process; serde's `Vec` caps its preallocation.

use imbl::OrdMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

pub fn serialize<K, V, S>(map: &OrdMap<K, V>, s: S) -> Result<S::Ok, S::Error>
where
    K: Serialize + Ord + Clone,
    V: Serialize + Clone,
    S: Serializer,
{
    s.collect_seq(map.iter())
}

pub fn deserialize<'de, K, V, D>(d: D) -> Result<OrdMap<K, V>, D::Error>
where
    K: Deserialize<'de> + Ord + Clone,
    V: Deserialize<'de> + Clone,
    D: Deserializer<'de>,
{
    let pairs: Vec<(K, V)> = Vec::deserialize(d)?;
    let n = pairs.len();
    let map: OrdMap<K, V> = pairs.into_iter().collect();
    if map.len() != n {
        return Err(serde::de::Error::custom("duplicate keys in a map"));
    }
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize, Deserialize, PartialEq, Debug)]
    struct W(#[serde(with = "super")] OrdMap<u64, u32>);

    #[test]
    fn round_trip_and_hostile_counts() {
        let w = W([(1u64, 2u32), (5, 6)].into_iter().collect());
        let bytes = postcard::to_stdvec(&w).unwrap();
        assert_eq!(postcard::from_bytes::<W>(&bytes).unwrap(), w);
        // A count of 2^50 pairs with no data behind it: an error, not an abort.
        let mut hostile = vec![0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x02];
        hostile.extend_from_slice(&[1, 2]);
        assert!(postcard::from_bytes::<W>(&hostile).is_err());
        // duplicate keys
        assert!(postcard::from_bytes::<W>(&[2, 1, 2, 1, 3]).is_err());
    }
}
