//! When a client certificate expires: its `notAfter`, read from the DER with the few steps of a
//! certificate's fixed layout that lead to it (RFC 5280, 4.1), so that `status` can say when the
//! credential in use expires without a full X.509 parser in the binary. Anything unexpected gives
//! `None` (the expiry is then unknown), never a panic.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

const SEQUENCE: u8 = 0x30;
const INTEGER: u8 = 0x02;
/// `[0] EXPLICIT Version`, present from X.509 v2 on.
const VERSION: u8 = 0xA0;
const UTC_TIME: u8 = 0x17;
const GENERALIZED_TIME: u8 = 0x18;

/// The certificate's `notAfter`, if `der` is a certificate whose validity can be read.
pub(crate) fn not_after(der: &[u8]) -> Option<SystemTime> {
    let cert = expect(der, SEQUENCE)?.0;
    let tbs = expect(cert, SEQUENCE)?.0;
    let mut rest = tbs;
    if let Some((VERSION, _, after)) = element(rest) {
        rest = after;
    }
    // serialNumber, signature (AlgorithmIdentifier), issuer (Name)
    for tag in [INTEGER, SEQUENCE, SEQUENCE] {
        rest = expect(rest, tag)?.1;
    }
    let validity = expect(rest, SEQUENCE)?.0;
    let (_, _, after_not_before) = element(validity)?;
    let (tag, time, _) = element(after_not_before)?;
    parse_time(tag, time)
}

/// One DER element: its tag, its content and what follows it.
fn element(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 {
            return None;
        }
        let (bytes, rest) = rest.split_at_checked(n)?;
        (
            bytes.iter().fold(0usize, |acc, b| (acc << 8) | usize::from(*b)),
            rest,
        )
    };
    let (content, rest) = rest.split_at_checked(len)?;
    Some((tag, content, rest))
}

/// The element at the start of `input`, if it has `tag`: its content and what follows.
fn expect(input: &[u8], tag: u8) -> Option<(&[u8], &[u8])> {
    match element(input)? {
        (t, content, rest) if t == tag => Some((content, rest)),
        _ => None,
    }
}

/// UTCTime `YYMMDDHHMMSSZ` (years 1950-2049) or GeneralizedTime `YYYYMMDDHHMMSSZ`.
fn parse_time(tag: u8, text: &[u8]) -> Option<SystemTime> {
    let (year, rest) = match (tag, text.len()) {
        (UTC_TIME, 13) => {
            let yy = digits(&text[..2])?;
            (if yy < 50 { 2000 + yy } else { 1900 + yy }, &text[2..])
        }
        (GENERALIZED_TIME, 15) => (digits(&text[..4])?, &text[4..]),
        _ => return None,
    };
    if rest.last() != Some(&b'Z') {
        return None;
    }
    let field = |i: usize| digits(rest.get(i..i + 2)?);
    let (month, day, hour, minute, second) = (field(0)?, field(2)?, field(4)?, field(6)?, field(8)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || minute > 59 || second > 60 {
        return None;
    }
    let days = days_from_civil(year, month, day);
    let secs = days * 86_400 + hour * 3_600 + minute * 60 + second;
    Some(UNIX_EPOCH + Duration::from_secs(u64::try_from(secs).ok()?))
}

/// An ASCII decimal number.
fn digits(text: &[u8]) -> Option<i64> {
    text.iter().try_fold(0i64, |acc, b| {
        b.is_ascii_digit().then(|| acc * 10 + i64::from(b - b'0'))
    })
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert_until(year: i32, month: u8, day: u8) -> Vec<u8> {
        let mut params = rcgen::CertificateParams::new(vec!["pump-17".into()]).expect("params");
        params.not_after = rcgen::date_time_ymd(year, month, day);
        let key = rcgen::KeyPair::generate().expect("key");
        params.self_signed(&key).expect("cert").der().to_vec()
    }

    fn ymd(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    #[test]
    fn reads_the_not_after_of_utc_and_generalized_times() {
        // 2031-04-05T00:00:00Z (UTCTime) and 2061-01-01T00:00:00Z (GeneralizedTime, past 2049).
        assert_eq!(not_after(&cert_until(2031, 4, 5)), Some(ymd(1_933_113_600)));
        assert_eq!(not_after(&cert_until(2061, 1, 1)), Some(ymd(2_871_763_200)));
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
    }

    #[test]
    fn anything_else_is_unknown_not_a_panic() {
        let der = cert_until(2031, 4, 5);
        for end in 0..der.len() {
            let _ = not_after(&der[..end]);
        }
        let mut flipped = der.clone();
        for i in 0..flipped.len() {
            flipped[i] ^= 0xff;
            let _ = not_after(&flipped);
            flipped[i] ^= 0xff;
        }
        assert_eq!(not_after(b""), None);
        assert_eq!(not_after(&[0x30, 0x84, 0xff, 0xff, 0xff, 0xff]), None);
        assert_eq!(parse_time(UTC_TIME, b"311345000000Z"), None, "month 13");
        assert_eq!(parse_time(UTC_TIME, b"31040500000x0"), None);
    }
}
