//! Property tests of the agent frame parser (`protocol::unframe`) and what the
//! engine does with a reply (`ExecReply` from the frame's JSON, then
//! `check_bundle` on its rich outputs): everything the guest writes to fd 3 is
//! hostile. Random bytes, frames with lying lengths, truncated and bit-flipped
//! valid frames, and random JSON values must give a value or a clean
//! `EngineError::Protocol`, never a panic; a frame's length is never trusted
//! beyond the bytes present; bundles stay within their caps.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use forkbox_engine::protocol::{self, check_bundle, ExecReply, DISPLAY_TOTAL_MAX};
use forkbox_engine::EngineError;
use proptest::prelude::*;
use serde_json::Value;

fn json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        "[ -~]{0,12}".prop_map(Value::String),
        prop_oneof![Just("text/plain"), Just("image/png"), Just("application/json"), Just("../x"), Just("a/b/c")]
            .prop_map(|s| Value::String(s.into())),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(
                prop_oneof![
                    Just("value".to_string()),
                    Just("error".to_string()),
                    Just("runtime_ms".to_string()),
                    Just("value_data".to_string()),
                    Just("display".to_string()),
                    Just("type".to_string()),
                    Just("message".to_string()),
                    Just("traceback".to_string()),
                    Just("text/plain".to_string()),
                    Just("image/png".to_string()),
                    Just("application/json".to_string()),
                    "[a-z/.]{0,8}",
                ],
                inner,
                0..6
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// What the engine does with one frame: parse, read as a reply, check its bundles.
fn consume(buf: &[u8]) -> Result<(), EngineError> {
    let (v, used) = protocol::unframe(buf)?;
    assert!(used >= 4 && used <= buf.len(), "used {used} of {}", buf.len());
    if let Ok(reply) = serde_json::from_value::<ExecReply>(v) {
        let mut total = 0usize;
        if let Some(b) = reply.value_data {
            check_bundle(b, &mut total);
        }
        for b in reply.display.unwrap_or_default() {
            check_bundle(b, &mut total);
        }
        assert!(total <= DISPLAY_TOTAL_MAX);
    }
    Ok(())
}

fn ok_or_protocol(r: Result<(), EngineError>) {
    match r {
        Ok(()) | Err(EngineError::Protocol(_)) => {}
        Err(e) => panic!("unframe failed with a non-protocol error: {e:?}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes(buf in prop::collection::vec(any::<u8>(), 0..256)) {
        ok_or_protocol(consume(&buf));
    }

    #[test]
    fn lying_lengths(len in prop_oneof![any::<u32>(), Just(u32::MAX), 0u32..64], body in prop::collection::vec(any::<u8>(), 0..128)) {
        let mut buf = len.to_le_bytes().to_vec();
        buf.extend_from_slice(&body);
        let r = protocol::unframe(&buf);
        if (len as usize) > body.len() {
            prop_assert!(matches!(r, Err(EngineError::Protocol(_))));
        }
        ok_or_protocol(consume(&buf));
    }

    #[test]
    fn random_json_replies(v in json(), cut in any::<usize>(), flip in any::<(usize, u8)>()) {
        let f = protocol::frame(&v);
        let (back, used) = protocol::unframe(&f).unwrap();
        prop_assert_eq!(used, f.len());
        // JSON numbers may come back in another form (floats); the structure must match.
        prop_assert_eq!(back.is_object(), v.is_object());
        ok_or_protocol(consume(&f));
        ok_or_protocol(consume(&f[..cut % (f.len() + 1)]));
        let mut g = f.clone();
        let i = flip.0 % g.len();
        g[i] ^= 1 << (flip.1 % 8);
        ok_or_protocol(consume(&g));
    }
}
