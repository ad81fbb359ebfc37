//! Locations in object stores: where checkpoints, savepoints and file-sink
//! output may live besides a directory. One check for the pipeline file,
//! the `weir` command and the operator, so that a location one of them
//! accepts is never refused by another at the first checkpoint.
//!
//! Deliberately only the shape of the URL: which server, account and
//! credentials a location reaches is a setting of the process (the
//! standard variables of each cloud's tools), never part of the URL, so
//! that no secret ends up in a message that names a location.

/// The object stores weir writes to, by URL scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ObjectStoreKind {
    /// `s3://BUCKET/PREFIX`: AWS S3 and S3-compatible servers (MinIO, Ceph, R2).
    S3,
    /// `gs://BUCKET/PREFIX`: Google Cloud Storage.
    Gcs,
    /// `az://CONTAINER/PREFIX`, `abfs[s]://CONTAINER/PREFIX` or
    /// `abfs[s]://CONTAINER@ACCOUNT.dfs.core.windows.net/PREFIX`: Azure Blob Storage.
    Azure,
}

/// The forms accepted, for messages.
pub const OBJECT_STORE_FORMS: &str = "s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or az://CONTAINER/PREFIX";

/// Azure hosts an `abfs[s]://CONTAINER@ACCOUNT.HOST` location may name.
const AZURE_HOSTS: [&str; 2] = ["dfs.core.windows.net", "blob.core.windows.net"];

/// What kind of object store `location` is in: `None` for a plain path
/// (or any text without `://`), an error naming what is wrong for a URL
/// weir cannot use.
pub fn object_store_kind(location: &str) -> Option<Result<ObjectStoreKind, String>> {
    let (scheme, rest) = location.split_once("://")?;
    let kind = match scheme {
        "s3" => ObjectStoreKind::S3,
        "gs" => ObjectStoreKind::Gcs,
        "az" | "abfs" | "abfss" => ObjectStoreKind::Azure,
        _ => return Some(Err(format!("unsupported scheme {scheme}://; expected {OBJECT_STORE_FORMS}"))),
    };
    Some(check_rest(kind, scheme, rest).map(|()| kind))
}

/// Checks what follows `scheme://`: a bucket (or container), an optional
/// prefix, and nothing that could carry a secret (user, password, query).
fn check_rest(kind: ObjectStoreKind, scheme: &str, rest: &str) -> Result<(), String> {
    let noun = if kind == ObjectStoreKind::Azure { "container" } else { "bucket" };
    let form = format!("{scheme}://{}/PREFIX", noun.to_uppercase());
    if rest.contains(['?', '#']) {
        return Err(format!("expected {form} without a query or fragment; credentials come from the environment"));
    }
    let host = rest.split('/').next().unwrap_or_default();
    let bucket = match host.split_once('@') {
        // The Hadoop driver's form names the account in the host.
        Some((container, account_host)) if scheme.starts_with("abfs") => {
            let known = account_host.split_once('.').is_some_and(|(account, h)| !account.is_empty() && AZURE_HOSTS.contains(&h));
            if !known {
                return Err(format!("expected {scheme}://CONTAINER@ACCOUNT.dfs.core.windows.net/PREFIX, not {account_host:?} after the @"));
            }
            container
        }
        Some(_) => return Err(format!("expected {form} without a user or password; credentials come from the environment")),
        None => host,
    };
    if bucket.is_empty() {
        return Err(format!("no {noun}: expected {form}"));
    }
    if bucket.contains(':') || bucket.contains('.') && kind == ObjectStoreKind::Azure {
        return Err(format!("{bucket:?} is not a {noun} name: expected {form}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_clouds_locations_are_recognised_and_paths_are_not_urls() {
        for (url, kind) in [
            ("s3://bucket/prefix", ObjectStoreKind::S3),
            ("s3://bucket", ObjectStoreKind::S3),
            ("gs://bucket/a/b", ObjectStoreKind::Gcs),
            ("az://container/prefix", ObjectStoreKind::Azure),
            ("abfss://container/prefix", ObjectStoreKind::Azure),
            ("abfss://container@account.dfs.core.windows.net/prefix", ObjectStoreKind::Azure),
        ] {
            assert_eq!(object_store_kind(url), Some(Ok(kind)), "{url}");
        }
        assert_eq!(object_store_kind("/var/lib/weir"), None);
        assert_eq!(object_store_kind("out"), None);
    }

    #[test]
    fn a_location_weir_cannot_use_is_refused_saying_what_is_expected() {
        for (url, says) in [
            ("hdfs://nn/x", "unsupported scheme hdfs://"),
            ("s3://", "no bucket: expected s3://BUCKET/PREFIX"),
            ("az:///prefix", "no container: expected az://CONTAINER/PREFIX"),
            ("s3://key:secret@bucket/x", "without a user or password"),
            ("gs://bucket/x?token=1", "without a query"),
            ("abfs://c@evil.example.com/x", "CONTAINER@ACCOUNT.dfs.core.windows.net"),
            ("az://my.container/x", "is not a container name"),
            ("s3://host:9000/bucket", "is not a bucket name"),
        ] {
            let err = object_store_kind(url).unwrap().unwrap_err();
            assert!(err.contains(says), "{url}: {err}");
            assert!(!err.contains("secret"), "{url}: the message repeats the location's secret: {err}");
        }
    }
}
