//! Any bytes: decoding an envelope (or unpacking a batch, plain or zlib) returns a value or an
//! error, never panics or hangs, and what decodes re-encodes to something that decodes to the
//! same envelope.
#![no_main]

use edge_outbox::{Envelope, Published};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(env) = Envelope::decode(data) {
        let again = Envelope::decode(&env.encode()).expect("a decoded envelope re-encodes validly");
        assert_eq!(again, env);
        // Payload decoding through serde: any CBOR value, and a typed one.
        let _ = env.payload_as::<ciborium::Value>();
        let _ = env.payload_as::<(String, u64)>();
    }
    if let Ok(items) = Published::decode_all(data) {
        for item in items {
            if let Published::Message(env) = item {
                assert_eq!(Envelope::decode(&env.encode()).expect("re-encodes validly"), env);
            }
        }
    }
});
