//! Signed sequencers: a fencing token that a store can check came from lockd, with no call to it.
//!
//! A bare token proves nothing: any client can send `Fencing-Token: 18446744073709551615` and
//! poison a resource for its real holder. A sequencer binds the resource and the token together
//! under the cluster's Ed25519 key, so a verifier that holds the public keys refuses a forged,
//! altered or foreign one offline (the idea of Chubby's sequencers).
//!
//! # Wire format, version 1 (all integers big-endian)
//!
//! | bytes | field |
//! |---|---|
//! | 4 | magic `LKS1` (also separates this signature domain from any other use of the key) |
//! | 8 | key id: the first 8 bytes of SHA-256 of the raw 32-byte public key |
//! | 8 | fencing token |
//! | 8 | lease expiry, unix ms (informative, as in `Acquire`) |
//! | 2 | resource length n, 1..=256 |
//! | n | resource, UTF-8 |
//! | 64 | Ed25519 signature over every byte before it |
//!
//! Nothing may follow the signature. In text (HTTP header, `lockd.fence`) a sequencer is standard
//! base64 with padding (RFC 4648 section 4); the alphabet has no `:`, so `resource:<sequencer>`
//! splits at the last colon as a plain fence does.
//!
//! Keys on disk are PEM: the private key as PKCS#8 (`PRIVATE KEY`), the public key as
//! SubjectPublicKeyInfo (`PUBLIC KEY`), the forms `openssl genpkey -algorithm ed25519` and
//! `openssl pkey -pubout` read and write.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use ring::signature::{ED25519, Ed25519KeyPair, KeyPair as _, UnparsedPublicKey};
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{PrivatePkcs8KeyDer, SubjectPublicKeyInfoDer};

use crate::{FencingToken, RESOURCE_MAX_BYTES, validate_resource};

const MAGIC: &[u8; 4] = b"LKS1";
const HEADER_LEN: usize = 4 + 8 + 8 + 8 + 2;
const SIGNATURE_LEN: usize = 64;
/// Longest sequencer in bytes (a 256-byte resource).
pub const SEQUENCER_MAX_BYTES: usize = HEADER_LEN + RESOURCE_MAX_BYTES + SIGNATURE_LEN;
/// Longest sequencer in base64 text.
pub const SEQUENCER_MAX_TEXT: usize = SEQUENCER_MAX_BYTES.div_ceil(3) * 4;

/// DER prefix of an Ed25519 SubjectPublicKeyInfo (RFC 8410); the raw key follows.
const ED25519_SPKI_PREFIX: [u8; 12] = [
    0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00,
];

/// Names a signing key: the first 8 bytes of SHA-256 of its raw public key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct KeyId(pub [u8; 8]);

impl KeyId {
    fn of(raw_public_key: &[u8]) -> KeyId {
        let digest = ring::digest::digest(&ring::digest::SHA256, raw_public_key);
        let mut id = [0u8; 8];
        id.copy_from_slice(&digest.as_ref()[..8]);
        KeyId(id)
    }
}

impl fmt::Display for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// What a verified sequencer says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sequencer {
    /// The resource the lease is for.
    pub resource: String,
    /// The lease's fencing token.
    pub token: FencingToken,
    /// When the lease expires, in Unix ms as lockd's table clock reckons it: informative only.
    pub expires_at_unix_ms: i64,
    /// The key that signed it.
    pub key_id: KeyId,
}

/// Why a sequencer or a key was refused. Messages name the value, never echo key material.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SequencerError {
    /// The text is not base64; the count is its length, not its content.
    #[error("sequencer is not valid base64 ({0} characters)")]
    NotBase64(usize),
    /// The bytes decode but are not a sequencer; says which part is wrong.
    #[error("sequencer is malformed: {0}")]
    Malformed(&'static str),
    /// Signed by a key the verifier was not given.
    #[error("sequencer is signed by key {0}, which is not among the verify keys")]
    UnknownKey(KeyId),
    /// The signature does not match the content under that key.
    #[error("sequencer signature does not verify with key {0}")]
    BadSignature(KeyId),
    /// The sequencer is for another resource than the write.
    #[error("sequencer names resource {found:?} but the write is for {expected:?}")]
    WrongResource {
        /// The write's resource.
        expected: String,
        /// The sequencer's resource.
        found: String,
    },
    /// The sequencer carries another token than the write claims.
    #[error("sequencer carries token {found} but the write claims {expected}")]
    WrongToken {
        /// The token the write claims.
        expected: FencingToken,
        /// The token in the sequencer.
        found: FencingToken,
    },
    /// A key file could not be read or is not a key of the expected kind.
    #[error("key {path}: {reason}")]
    KeyFile {
        /// The file.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
}

/// The cluster's private signing key.
pub struct SigningKey {
    pair: Ed25519KeyPair,
    pkcs8: Vec<u8>,
    key_id: KeyId,
}

impl fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the secret.
        write!(f, "SigningKey({})", self.key_id)
    }
}

impl SigningKey {
    /// Makes a new key from the system CSPRNG.
    pub fn generate() -> SigningKey {
        let rng = ring::rand::SystemRandom::new();
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&rng)
            .expect("the system random source failed while making an Ed25519 key");
        SigningKey::from_pkcs8_der(pkcs8.as_ref()).expect("ring reads back the key it made")
    }

    /// Reads a PKCS#8 DER key (v1 as openssl writes it, or v2 as ring writes it).
    pub fn from_pkcs8_der(der: &[u8]) -> Result<SigningKey, SequencerError> {
        let pair = Ed25519KeyPair::from_pkcs8_maybe_unchecked(der).map_err(|e| {
            SequencerError::KeyFile {
                path: "<pkcs8>".to_owned(),
                reason: format!("not an Ed25519 PKCS#8 private key ({e})"),
            }
        })?;
        let key_id = KeyId::of(pair.public_key().as_ref());
        Ok(SigningKey {
            pair,
            pkcs8: der.to_vec(),
            key_id,
        })
    }

    /// Reads a `PRIVATE KEY` PEM file.
    pub fn from_pem_file(path: &Path) -> Result<SigningKey, SequencerError> {
        let der = PrivatePkcs8KeyDer::from_pem_file(path).map_err(|e| key_file_error(path, e))?;
        SigningKey::from_pkcs8_der(der.secret_pkcs8_der()).map_err(|e| match e {
            SequencerError::KeyFile { reason, .. } => SequencerError::KeyFile {
                path: path.display().to_string(),
                reason,
            },
            other => other,
        })
    }

    /// The PKCS#8 DER form, as replicated and stored.
    pub fn pkcs8_der(&self) -> &[u8] {
        &self.pkcs8
    }

    /// The private key as a `PRIVATE KEY` PEM document.
    pub fn to_pem(&self) -> String {
        pem_encode("PRIVATE KEY", &self.pkcs8)
    }

    /// The id of this key, which every sequencer it signs names.
    pub fn key_id(&self) -> KeyId {
        self.key_id
    }

    /// The public half, to give verifiers.
    pub fn public_key(&self) -> PublicKey {
        let mut raw = [0u8; 32];
        raw.copy_from_slice(self.pair.public_key().as_ref());
        PublicKey {
            raw,
            key_id: self.key_id,
        }
    }

    /// Signs a grant. Ed25519 is deterministic: the same grant always gives the same bytes, so a
    /// retried `Acquire` returns an identical sequencer.
    pub fn sign(&self, resource: &str, token: FencingToken, expires_at_unix_ms: i64) -> Vec<u8> {
        debug_assert!(
            validate_resource(resource).is_ok(),
            "lockd signs only valid resources"
        );
        let mut out = Vec::with_capacity(HEADER_LEN + resource.len() + SIGNATURE_LEN);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.key_id.0);
        out.extend_from_slice(&token.0.to_be_bytes());
        out.extend_from_slice(&expires_at_unix_ms.to_be_bytes());
        out.extend_from_slice(&(resource.len() as u16).to_be_bytes());
        out.extend_from_slice(resource.as_bytes());
        let signature = self.pair.sign(&out);
        out.extend_from_slice(signature.as_ref());
        out
    }
}

/// A public key that verifies sequencers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublicKey {
    raw: [u8; 32],
    key_id: KeyId,
}

impl PublicKey {
    /// The key from its 32 raw Ed25519 bytes.
    pub fn from_raw(raw: [u8; 32]) -> PublicKey {
        PublicKey {
            raw,
            key_id: KeyId::of(&raw),
        }
    }

    /// Reads a DER SubjectPublicKeyInfo holding an Ed25519 key.
    pub fn from_spki_der(der: &[u8]) -> Result<PublicKey, &'static str> {
        if der.len() != ED25519_SPKI_PREFIX.len() + 32 || der[..12] != ED25519_SPKI_PREFIX {
            return Err("not an Ed25519 public key (SubjectPublicKeyInfo, RFC 8410)");
        }
        let mut raw = [0u8; 32];
        raw.copy_from_slice(&der[12..]);
        Ok(PublicKey::from_raw(raw))
    }

    /// Reads a `PUBLIC KEY` PEM file.
    pub fn from_pem_file(path: &Path) -> Result<PublicKey, SequencerError> {
        let der =
            SubjectPublicKeyInfoDer::from_pem_file(path).map_err(|e| key_file_error(path, e))?;
        PublicKey::from_spki_der(der.as_ref()).map_err(|reason| SequencerError::KeyFile {
            path: path.display().to_string(),
            reason: reason.to_owned(),
        })
    }

    /// The 32 raw Ed25519 bytes.
    pub fn raw(&self) -> &[u8; 32] {
        &self.raw
    }

    /// The id sequencers signed by this key name.
    pub fn key_id(&self) -> KeyId {
        self.key_id
    }

    /// The key as a `PUBLIC KEY` PEM document.
    pub fn to_pem(&self) -> String {
        let mut der = ED25519_SPKI_PREFIX.to_vec();
        der.extend_from_slice(&self.raw);
        pem_encode("PUBLIC KEY", &der)
    }
}

/// The public keys a verifier trusts, by key id.
#[derive(Clone, Debug, Default)]
pub struct VerifyKeys {
    keys: BTreeMap<KeyId, PublicKey>,
}

impl VerifyKeys {
    /// Trusts exactly `keys`.
    pub fn new(keys: impl IntoIterator<Item = PublicKey>) -> VerifyKeys {
        VerifyKeys {
            keys: keys.into_iter().map(|k| (k.key_id, k)).collect(),
        }
    }

    /// Loads one `PUBLIC KEY` PEM file per path (`--verify-key`, repeatable).
    pub fn from_pem_files<P: AsRef<Path>>(paths: &[P]) -> Result<VerifyKeys, SequencerError> {
        let keys = paths
            .iter()
            .map(|p| PublicKey::from_pem_file(p.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(VerifyKeys::new(keys))
    }

    /// Whether no key is trusted (nothing can verify).
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The ids of the trusted keys, in order.
    pub fn key_ids(&self) -> impl Iterator<Item = KeyId> + '_ {
        self.keys.keys().copied()
    }

    /// Checks the format and the signature and returns what the sequencer says. It does not look
    /// at the expiry: fencing, not time, decides whether a write is stale, and a renewed lease
    /// keeps the sequencer of its grant.
    pub fn verify(&self, bytes: &[u8]) -> Result<Sequencer, SequencerError> {
        let unsigned = parse(bytes)?;
        let key = self
            .keys
            .get(&unsigned.sequencer.key_id)
            .ok_or(SequencerError::UnknownKey(unsigned.sequencer.key_id))?;
        UnparsedPublicKey::new(&ED25519, &key.raw)
            .verify(unsigned.signed_part, unsigned.signature)
            .map_err(|_| SequencerError::BadSignature(key.key_id))?;
        Ok(unsigned.sequencer)
    }

    /// Decodes base64 text and verifies it.
    pub fn verify_text(&self, text: &str) -> Result<Sequencer, SequencerError> {
        self.verify(&decode_text(text)?)
    }

    /// Verifies and checks that the sequencer is for this resource and, when the caller also sent a
    /// plain token, that the two agree.
    pub fn verify_for(
        &self,
        bytes: &[u8],
        resource: &str,
        claimed_token: Option<FencingToken>,
    ) -> Result<Sequencer, SequencerError> {
        let seq = self.verify(bytes)?;
        if seq.resource != resource {
            return Err(SequencerError::WrongResource {
                expected: resource.to_owned(),
                found: seq.resource,
            });
        }
        if let Some(expected) = claimed_token
            && expected != seq.token
        {
            return Err(SequencerError::WrongToken {
                expected,
                found: seq.token,
            });
        }
        Ok(seq)
    }
}

/// Base64 text of a sequencer.
pub fn encode_text(bytes: &[u8]) -> String {
    BASE64.encode(bytes)
}

/// Bytes of a sequencer's base64 text; refuses oversize text before decoding.
pub fn decode_text(text: &str) -> Result<Vec<u8>, SequencerError> {
    if text.len() > SEQUENCER_MAX_TEXT {
        return Err(SequencerError::Malformed("longer than any sequencer"));
    }
    BASE64
        .decode(text.as_bytes())
        .map_err(|_| SequencerError::NotBase64(text.len()))
}

/// Reads the fields without checking the signature. Only for display (`lockctl`); a store must use
/// [`VerifyKeys::verify`].
pub fn inspect_unverified(bytes: &[u8]) -> Result<Sequencer, SequencerError> {
    parse(bytes).map(|u| u.sequencer)
}

struct Unverified<'a> {
    sequencer: Sequencer,
    signed_part: &'a [u8],
    signature: &'a [u8],
}

fn parse(bytes: &[u8]) -> Result<Unverified<'_>, SequencerError> {
    use SequencerError::Malformed;
    if bytes.len() < HEADER_LEN + 1 + SIGNATURE_LEN {
        return Err(Malformed("too short"));
    }
    if bytes.len() > SEQUENCER_MAX_BYTES {
        return Err(Malformed("too long"));
    }
    if &bytes[..4] != MAGIC {
        return Err(Malformed("unknown magic or version"));
    }
    let u64_at = |at: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&bytes[at..at + 8]);
        b
    };
    let key_id = KeyId(u64_at(4));
    let token = FencingToken(u64::from_be_bytes(u64_at(12)));
    let expires_at_unix_ms = i64::from_be_bytes(u64_at(20));
    let resource_len = u16::from_be_bytes([bytes[28], bytes[29]]) as usize;
    if bytes.len() != HEADER_LEN + resource_len + SIGNATURE_LEN {
        return Err(Malformed("length does not match the resource length"));
    }
    let signed_end = HEADER_LEN + resource_len;
    let resource = std::str::from_utf8(&bytes[HEADER_LEN..signed_end])
        .map_err(|_| Malformed("resource is not UTF-8"))?;
    validate_resource(resource).map_err(|_| Malformed("resource breaks lockd's policy"))?;
    Ok(Unverified {
        sequencer: Sequencer {
            resource: resource.to_owned(),
            token,
            expires_at_unix_ms,
            key_id,
        },
        signed_part: &bytes[..signed_end],
        signature: &bytes[signed_end..],
    })
}

fn key_file_error(path: &Path, e: rustls_pki_types::pem::Error) -> SequencerError {
    SequencerError::KeyFile {
        path: path.display().to_string(),
        reason: format!("cannot read a PEM key ({e})"),
    }
}

fn pem_encode(label: &str, der: &[u8]) -> String {
    let body = BASE64.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in body.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).expect("base64 is ASCII"));
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(k: &SigningKey) -> VerifyKeys {
        VerifyKeys::new([k.public_key()])
    }

    #[test]
    fn a_signed_grant_verifies_and_says_what_was_signed() {
        let k = SigningKey::generate();
        let bytes = k.sign("orders/42", FencingToken(7), 1_700_000_000_000);
        let seq = keys(&k).verify(&bytes).unwrap();
        assert_eq!(seq.resource, "orders/42");
        assert_eq!(seq.token, FencingToken(7));
        assert_eq!(seq.expires_at_unix_ms, 1_700_000_000_000);
        assert_eq!(seq.key_id, k.key_id());
        assert_eq!(
            bytes,
            k.sign("orders/42", FencingToken(7), 1_700_000_000_000)
        );
        let text = encode_text(&bytes);
        assert!(!text.contains(':'));
        assert!(text.len() <= SEQUENCER_MAX_TEXT);
        assert_eq!(keys(&k).verify_text(&text).unwrap(), seq);
    }

    #[test]
    fn every_flipped_bit_is_refused() {
        let k = SigningKey::generate();
        let v = keys(&k);
        let bytes = k.sign("r", FencingToken(41), 5);
        for i in 0..bytes.len() * 8 {
            let mut b = bytes.clone();
            b[i / 8] ^= 1 << (i % 8);
            assert!(v.verify(&b).is_err(), "bit {i} flipped still verified");
        }
        for len in 0..bytes.len() {
            assert!(
                v.verify(&bytes[..len]).is_err(),
                "truncated to {len} verified"
            );
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(v.verify(&longer).is_err());
    }

    #[test]
    fn a_foreign_key_is_unknown_and_a_resigned_forgery_is_bad() {
        let ours = SigningKey::generate();
        let theirs = SigningKey::generate();
        let forged = theirs.sign("r", FencingToken(u64::MAX), 0);
        assert_eq!(
            keys(&ours).verify(&forged),
            Err(SequencerError::UnknownKey(theirs.key_id()))
        );
        // Claim our key id but sign with theirs.
        let mut spoofed = forged.clone();
        spoofed[4..12].copy_from_slice(&ours.key_id().0);
        let body_end = spoofed.len() - SIGNATURE_LEN;
        let sig = theirs.pair.sign(&spoofed[..body_end]);
        spoofed[body_end..].copy_from_slice(sig.as_ref());
        assert_eq!(
            keys(&ours).verify(&spoofed),
            Err(SequencerError::BadSignature(ours.key_id()))
        );
    }

    #[test]
    fn verify_for_checks_resource_and_claimed_token() {
        let k = SigningKey::generate();
        let v = keys(&k);
        let bytes = k.sign("a", FencingToken(3), 0);
        assert!(v.verify_for(&bytes, "a", Some(FencingToken(3))).is_ok());
        assert!(v.verify_for(&bytes, "a", None).is_ok());
        assert!(matches!(
            v.verify_for(&bytes, "b", None),
            Err(SequencerError::WrongResource { .. })
        ));
        assert!(matches!(
            v.verify_for(&bytes, "a", Some(FencingToken(4))),
            Err(SequencerError::WrongToken { .. })
        ));
    }

    #[test]
    fn keys_round_trip_through_pem() {
        let dir = std::env::temp_dir().join(format!("lockd-seq-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let k = SigningKey::generate();
        let private = dir.join("k.pem");
        let public = dir.join("k.pub.pem");
        std::fs::write(&private, k.to_pem()).unwrap();
        std::fs::write(&public, k.public_key().to_pem()).unwrap();
        let k2 = SigningKey::from_pem_file(&private).unwrap();
        assert_eq!(k2.key_id(), k.key_id());
        let v = VerifyKeys::from_pem_files(&[&public]).unwrap();
        assert!(v.verify(&k2.sign("r", FencingToken(1), 0)).is_ok());
        let err = VerifyKeys::from_pem_files(&[&private]).unwrap_err();
        assert!(err.to_string().contains("k.pem"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Keys as `openssl genpkey -algorithm ed25519` and `openssl pkey -pubout` write them
    /// (PKCS#8 v1 and SubjectPublicKeyInfo), checked in as text.
    #[test]
    fn openssl_keys_are_read() {
        let dir = std::env::temp_dir().join(format!("lockd-seq-openssl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("k.pem"), OPENSSL_PRIVATE).unwrap();
        std::fs::write(dir.join("k.pub.pem"), OPENSSL_PUBLIC).unwrap();
        let k = SigningKey::from_pem_file(&dir.join("k.pem")).unwrap();
        let v = VerifyKeys::from_pem_files(&[dir.join("k.pub.pem")]).unwrap();
        assert!(v.verify(&k.sign("r", FencingToken(9), 0)).is_ok());
        assert_eq!(k.public_key().to_pem(), OPENSSL_PUBLIC);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    const OPENSSL_PRIVATE: &str = "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIIpMuehUOVjJnSD7cvQLXxxTizYX6iT1mlhPjudM7tQT\n-----END PRIVATE KEY-----\n";
    const OPENSSL_PUBLIC: &str = "-----BEGIN PUBLIC KEY-----\nMCowBQYDK2VwAyEAg8gzKeaMy7zZcnCO9YzyELqwRC7exz6XWWq8JPaJsgs=\n-----END PUBLIC KEY-----\n";

    #[test]
    fn oversize_or_non_base64_text_is_refused_before_decoding() {
        let v = VerifyKeys::default();
        assert!(matches!(
            v.verify_text(&"A".repeat(SEQUENCER_MAX_TEXT + 4)),
            Err(SequencerError::Malformed(_))
        ));
        assert!(matches!(
            v.verify_text("not base64!"),
            Err(SequencerError::NotBase64(_))
        ));
    }
}
