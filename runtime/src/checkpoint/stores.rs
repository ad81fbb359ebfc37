//! The object stores behind locations that are URLs: S3 (`s3.rs` has its
//! settings), Azure Blob Storage and Google Cloud Storage, all through
//! `object_store`'s own clients.
//!
//! Where an Azure or Google store is and who weir is there come only from
//! the standard variables of each cloud's tools, read by `object_store`:
//! `AZURE_STORAGE_ACCOUNT_NAME` with `AZURE_STORAGE_ACCOUNT_KEY`, a SAS
//! token or a workload identity, `AZURE_STORAGE_USE_EMULATOR` for Azurite;
//! `GOOGLE_APPLICATION_CREDENTIALS` (or `GOOGLE_SERVICE_ACCOUNT`) or the
//! metadata server of a GKE pod. weir adds no flags of its own for them,
//! so a pod or shell set up for `az` or `gcloud` works as it is, and no
//! secret is ever part of a location, a command line or a message.

use std::sync::Arc;
use std::time::Duration;

use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::multipart::MultipartStore;
use object_store::{BackoffConfig, ClientConfigKey, ObjectStore, RetryConfig};
use weir_api::object_store_url::{object_store_kind, ObjectStoreKind};

/// A store that can also upload an object in parts that outlive the
/// process (the file sink's staged files); every cloud store is one.
pub(crate) trait StagingStore: ObjectStore + MultipartStore {}

impl<T: ObjectStore + MultipartStore> StagingStore for T {}

/// Requests are retried with backoff for up to a minute, so a store that
/// is briefly unreachable costs a slow checkpoint, not a failed run.
pub(crate) fn retry() -> RetryConfig {
    RetryConfig {
        backoff: BackoffConfig { init_backoff: Duration::from_millis(100), max_backoff: Duration::from_secs(5), base: 2.0 },
        max_retries: 15,
        retry_timeout: Duration::from_secs(60),
    }
}

/// The store of `url`, one of [`object_store_kind`]'s; the error says what
/// to change (the location's form, or which variable).
pub(crate) fn open(url: &url::Url) -> Result<Arc<dyn StagingStore>, String> {
    let kind = match object_store_kind(url.as_str()) {
        Some(Ok(kind)) => kind,
        Some(Err(e)) => return Err(e),
        None => return Err("not an object store location".into()),
    };
    match kind {
        ObjectStoreKind::S3 => Ok(Arc::new(super::s3::amazon_s3(url)?)),
        ObjectStoreKind::Azure => azure(url),
        ObjectStoreKind::Gcs => gcs(url),
    }
}

fn azure(url: &url::Url) -> Result<Arc<dyn StagingStore>, String> {
    // Timeouts through the configuration, so that the client settings
    // the environment gives (AZURE_ALLOW_HTTP, a proxy) are kept.
    let store = MicrosoftAzureBuilder::from_env()
        .with_url(url.as_str())
        .with_retry(retry())
        .with_config(AzureConfigKey::Client(ClientConfigKey::ConnectTimeout), "5s")
        .with_config(AzureConfigKey::Client(ClientConfigKey::Timeout), "60s")
        .build()
        .map_err(|e| {
            format!(
                "{e} (an Azure location takes its account and credentials from AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY, \
                 a SAS token or a workload identity; AZURE_STORAGE_USE_EMULATOR=true with AZURITE_BLOB_STORAGE_URL for Azurite)"
            )
        })?;
    Ok(Arc::new(store))
}

fn gcs(url: &url::Url) -> Result<Arc<dyn StagingStore>, String> {
    let store = GoogleCloudStorageBuilder::from_env()
        .with_url(url.as_str())
        .with_retry(retry())
        .with_config(GoogleConfigKey::Client(ClientConfigKey::ConnectTimeout), "5s")
        .with_config(GoogleConfigKey::Client(ClientConfigKey::Timeout), "60s")
        .build()
        .map_err(|e| {
            format!("{e} (a gs:// location takes its credentials from GOOGLE_APPLICATION_CREDENTIALS or GOOGLE_SERVICE_ACCOUNT, else from the metadata server)")
        })?;
    Ok(Arc::new(store))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_azure_location_without_an_account_names_the_variables_to_set() {
        // Only meaningful where the test's environment names no account.
        if std::env::vars().any(|(k, _)| k.starts_with("AZURE_")) {
            return;
        }
        let err = open(&url::Url::parse("az://container/prefix").unwrap()).err().expect("an account was found");
        assert!(err.contains("AZURE_STORAGE_ACCOUNT_NAME") && err.contains("AZURE_STORAGE_USE_EMULATOR"), "{err}");
    }

    #[test]
    fn a_location_with_credentials_in_it_is_refused_before_any_client_is_built() {
        let err = open(&url::Url::parse("gs://user:secret@bucket/x").unwrap()).err().expect("accepted");
        assert!(err.contains("without a user or password") && !err.contains("secret@"), "{err}");
    }
}
