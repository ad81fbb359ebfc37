//! The operator's control key: one secret of the operator, kept in a Secret
//! in its own namespace, from which the control token of every job is
//! derived (an HMAC of the job's uid).
//!
//! Why derived: a job's workers get their token from a Secret in the job's
//! namespace, which the operator must create. If the operator also had to
//! read those Secrets back (after a restart), it would need `get` on every
//! Secret of the cluster, and a compromised operator could read them all.
//! With a derived token the operator only ever creates job Secrets (RBAC
//! cannot narrow `create` by name, but a create reveals nothing) and reads
//! exactly one Secret, its own key, named in its Role.
//!
//! What this module does not know: the Secret's name and namespace (the
//! chart's, passed on the command line) and how workers use the token (the
//! runtime signs its control requests and derives its run keys from it).

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::ByteString;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::Client;
use tracing::info;

use crate::error::{Error, Result};

/// The key's entry in its Secret.
pub const KEY_FIELD: &str = "key";
/// Fewer bytes than this is no key (a hand-made Secret with a short value).
const MIN_KEY_BYTES: usize = 32;

/// The key. Its Debug output never shows the bytes.
#[derive(Clone)]
pub struct ControlKey(ring::hmac::Key);

impl fmt::Debug for ControlKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ControlKey(…)")
    }
}

impl ControlKey {
    /// A key from its bytes; too short a key is refused.
    pub fn from_bytes(bytes: &[u8]) -> std::result::Result<ControlKey, String> {
        if bytes.len() < MIN_KEY_BYTES {
            return Err(format!("the key has {} bytes; at least {MIN_KEY_BYTES} are needed", bytes.len()));
        }
        Ok(ControlKey(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, bytes)))
    }

    /// A new random key (also what tests use).
    pub fn random() -> ControlKey {
        ControlKey::from_bytes(&random_bytes()).expect("32 random bytes are a key")
    }

    /// A short name of the key that reveals nothing of it (32 bits of an
    /// HMAC), part of each job's token Secret name: with a new key (its
    /// Secret deleted) every job gets a new token Secret, instead of the one
    /// holding the old key's token, which the operator may not change.
    pub fn id(&self) -> String {
        let tag = ring::hmac::sign(&self.0, b"weir-control-key-id");
        tag.as_ref()[..4].iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The control token of the job with this uid: 256 bits, hex. The same
    /// for every replica and every restart of the operator, different for
    /// every job (a new job of the same name has a new uid).
    pub fn token(&self, job_uid: &str) -> String {
        let tag = ring::hmac::sign(&self.0, format!("weir-control-token:{job_uid}").as_bytes());
        tag.as_ref().iter().map(|b| format!("{b:02x}")).collect()
    }
}

fn random_bytes() -> Vec<u8> {
    use rand::RngCore;
    let mut bytes = vec![0u8; MIN_KEY_BYTES];
    rand::rng().fill_bytes(&mut bytes);
    bytes
}

/// Reads the key from Secret `name` in `namespace`, or creates that Secret
/// with a new random key. Two replicas starting together both try to
/// create it; the one that loses reads the winner's.
pub async fn load_or_create(client: Client, namespace: &str, name: &str) -> Result<ControlKey> {
    let secrets: Api<Secret> = Api::namespaced(client, namespace);
    let what = || format!("the control key Secret {namespace}/{name}");
    if let Some(secret) = secrets.get_opt(name).await.map_err(Error::kube(format!("reading {}", what())))? {
        return key_of(&secret).map_err(|message| Error::Build { object: what(), message });
    }
    let secret = Secret {
        metadata: ObjectMeta { name: Some(name.into()), namespace: Some(namespace.into()), ..Default::default() },
        type_: Some("Opaque".into()),
        data: Some(BTreeMap::from([(KEY_FIELD.to_string(), ByteString(random_bytes()))])),
        ..Default::default()
    };
    match secrets.create(&PostParams::default(), &secret).await {
        Ok(created) => {
            info!(secret = %what(), "created the control key");
            key_of(&created).map_err(|message| Error::Build { object: what(), message })
        }
        Err(kube::Error::Api(e)) if e.code == 409 => {
            let secret = secrets.get(name).await.map_err(Error::kube(format!("reading {}", what())))?;
            key_of(&secret).map_err(|message| Error::Build { object: what(), message })
        }
        Err(e) => Err(Error::kube(format!("creating {}", what()))(e)),
    }
}

/// The key in a Secret, or what is wrong with the Secret.
pub fn key_of(secret: &Secret) -> std::result::Result<ControlKey, String> {
    let bytes = secret
        .data
        .as_ref()
        .and_then(|d| d.get(KEY_FIELD))
        .ok_or_else(|| format!("it has no data.{KEY_FIELD}; delete it and the operator creates a new one (every job restarts once from its latest checkpoint)"))?;
    ControlKey::from_bytes(&bytes.0).map_err(|e| format!("data.{KEY_FIELD}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_the_same_for_the_same_key_and_job_and_differs_otherwise() {
        let key = ControlKey::from_bytes(&[7u8; 32]).unwrap();
        let again = ControlKey::from_bytes(&[7u8; 32]).unwrap();
        assert_eq!(key.token("uid-1"), again.token("uid-1"), "another replica or a restart derives the same token");
        assert_ne!(key.token("uid-1"), key.token("uid-2"), "each job has its own token");
        assert_ne!(key.token("uid-1"), ControlKey::from_bytes(&[8u8; 32]).unwrap().token("uid-1"), "another key, another token");
        let token = key.token("uid-1");
        assert_eq!(token.len(), 64);
        assert_eq!(key.id(), again.id());
        assert_ne!(key.id(), ControlKey::from_bytes(&[8u8; 32]).unwrap().id(), "another key, another token Secret");
        assert!(!token.starts_with(&key.id()), "the id is not a piece of a token");
        assert!(token.chars().all(|c| c.is_ascii_hexdigit()));
    }

    #[test]
    fn a_short_or_missing_key_is_refused_with_what_to_do() {
        assert!(ControlKey::from_bytes(&[1u8; 31]).unwrap_err().contains("31 bytes"));
        let empty = Secret::default();
        assert!(key_of(&empty).unwrap_err().contains("no data.key; delete it"));
        let short = Secret { data: Some(BTreeMap::from([(KEY_FIELD.to_string(), ByteString(b"short".to_vec()))])), ..Default::default() };
        assert!(key_of(&short).unwrap_err().contains("data.key: the key has 5 bytes"));
    }

    #[test]
    fn the_key_is_never_printed() {
        assert_eq!(format!("{:?}", ControlKey::from_bytes(&[0x41u8; 32]).unwrap()), "ControlKey(…)");
    }
}
