//! Where the store is and how to talk to it, configured the S3 way: a
//! location `s3://BUCKET[/PREFIX]`, and the endpoint, credentials and
//! region from `AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY` (and `AWS_SESSION_TOKEN`), `AWS_REGION` or given
//! explicitly. Nothing here prints a credential: [`Secret`] shows as
//! `<redacted>` in `Debug`, and the configuration has no `Display`.

use std::str::FromStr;
use std::time::Duration;

use crate::error::{Error, Result};

/// A location in a store: `s3://BUCKET[/PREFIX]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteUrl {
    /// The bucket.
    pub bucket: String,
    /// The key prefix everything goes under, without leading or trailing
    /// `/` (empty: the bucket's root).
    pub prefix: String,
}

impl FromStr for RemoteUrl {
    type Err = Error;

    fn from_str(url: &str) -> Result<Self> {
        let bad = |reason| Error::ParseUrl {
            url: url.chars().take(200).collect(),
            reason,
        };
        let rest = url
            .strip_prefix("s3://")
            .ok_or_else(|| bad("it does not start with s3://"))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        // S3's bucket naming rules, which RGW and MinIO share.
        let bucket_ok = (3..=63).contains(&bucket.len())
            && bucket
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
            && bucket
                .bytes()
                .next()
                .is_some_and(|b| b.is_ascii_alphanumeric())
            && bucket
                .bytes()
                .last()
                .is_some_and(|b| b.is_ascii_alphanumeric());
        if !bucket_ok {
            return Err(bad(
                "the bucket must be 3 to 63 of [a-z0-9.-], starting and ending with a letter or digit",
            ));
        }
        let prefix = prefix.trim_end_matches('/');
        let prefix_ok = prefix.split('/').all(|part| {
            !part.is_empty()
                && part != "."
                && part != ".."
                && part
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        });
        if !prefix.is_empty() && !prefix_ok {
            return Err(bad(
                "the prefix must be /-separated parts of [A-Za-z0-9._-], none empty, . or ..",
            ));
        }
        Ok(Self {
            bucket: bucket.to_owned(),
            prefix: prefix.to_owned(),
        })
    }
}

impl std::fmt::Display for RemoteUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.prefix.is_empty() {
            write!(f, "s3://{}", self.bucket)
        } else {
            write!(f, "s3://{}/{}", self.bucket, self.prefix)
        }
    }
}

/// A value that must never be printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wrap `value`.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value, for the client that signs requests with it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// S3 credentials.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub access_key_id: Secret,
    pub secret_access_key: Secret,
    /// For temporary credentials.
    pub session_token: Option<Secret>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Credentials(<redacted>)")
    }
}

/// Limits and sizes of the client's work.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tuning {
    /// Requests in flight at once in a push, a pull or a gc.
    pub concurrency: usize,
    /// zstd level of stored chunks.
    pub zstd_level: i32,
    /// Time to connect.
    pub connect_timeout: Duration,
    /// Time for one request, body included.
    pub request_timeout: Duration,
    /// Retries of a failed idempotent request.
    pub retries: usize,
    /// Time after which a request is not retried any more.
    pub retry_timeout: Duration,
    /// Time for one chunk fetch, retries included: past it the fetch
    /// fails as [`Error::Deadline`].
    pub fetch_deadline: Duration,
    /// How long a push's or a gc's lock in the store is trusted without
    /// being refreshed (see the crate doc, "Pushes and gc").
    pub lock_ttl: Duration,
    /// How long a push waits for a running gc to end.
    pub busy_wait: Duration,
}

impl Default for Tuning {
    fn default() -> Self {
        Self {
            concurrency: 16,
            zstd_level: 1,
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(30),
            retries: 3,
            retry_timeout: Duration::from_secs(20),
            fetch_deadline: Duration::from_secs(30),
            lock_ttl: Duration::from_secs(300),
            busy_wait: Duration::from_secs(120),
        }
    }
}

/// Everything needed to reach a store.
#[derive(Debug, Clone)]
pub struct RemoteConfig {
    pub url: RemoteUrl,
    /// `http(s)://host:port` of an S3-compatible service; `None`: AWS.
    pub endpoint: Option<String>,
    pub region: String,
    pub credentials: Credentials,
    pub tuning: Tuning,
}

/// The default region when none is set (what RGW and MinIO accept).
pub const DEFAULT_REGION: &str = "us-east-1";

impl RemoteConfig {
    /// `url` with the endpoint, credentials and region of the standard AWS
    /// environment variables.
    pub fn from_env(url: &str) -> Result<Self> {
        Self::from_lookup(url, |k| std::env::var(k).ok().filter(|v| !v.is_empty()))
    }

    /// As [`RemoteConfig::from_env`], reading variables through `get`.
    pub fn from_lookup(url: &str, get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let url: RemoteUrl = url.parse()?;
        let access_key_id = get("AWS_ACCESS_KEY_ID").ok_or(Error::MissingSetting {
            what: "access key id",
            env: "AWS_ACCESS_KEY_ID",
        })?;
        let secret = get("AWS_SECRET_ACCESS_KEY").ok_or(Error::MissingSetting {
            what: "secret access key",
            env: "AWS_SECRET_ACCESS_KEY",
        })?;
        Ok(Self {
            url,
            endpoint: get("AWS_ENDPOINT_URL_S3").or_else(|| get("AWS_ENDPOINT_URL")),
            region: get("AWS_REGION")
                .or_else(|| get("AWS_DEFAULT_REGION"))
                .unwrap_or_else(|| DEFAULT_REGION.to_owned()),
            credentials: Credentials {
                access_key_id: Secret::new(access_key_id),
                secret_access_key: Secret::new(secret),
                session_token: get("AWS_SESSION_TOKEN").map(Secret::new),
            },
            tuning: Tuning::default(),
        })
    }

    /// The endpoint as messages name it.
    pub fn endpoint_name(&self) -> String {
        self.endpoint
            .clone()
            .unwrap_or_else(|| format!("https://s3.{}.amazonaws.com", self.region))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn locations_parse_and_print() {
        let u: RemoteUrl = "s3://pagefork".parse().unwrap();
        assert_eq!((u.bucket.as_str(), u.prefix.as_str()), ("pagefork", ""));
        assert_eq!(u.to_string(), "s3://pagefork");
        let u: RemoteUrl = "s3://my.bucket-1/fleet/a/".parse().unwrap();
        assert_eq!(u.prefix, "fleet/a");
        assert_eq!(u.to_string(), "s3://my.bucket-1/fleet/a");
        for bad in [
            "pagefork",
            "http://x/y",
            "s3://",
            "s3://ab",
            "s3://Upper",
            "s3://b-/x",
            "s3://bucket//x",
            "s3://bucket/../x",
            "s3://bucket/a b",
        ] {
            assert!(bad.parse::<RemoteUrl>().is_err(), "{bad}");
        }
    }

    #[test]
    fn environment_gives_endpoint_credentials_and_region() {
        let env = HashMap::from([
            ("AWS_ENDPOINT_URL", "http://127.0.0.1:7480"),
            ("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE"),
            (
                "AWS_SECRET_ACCESS_KEY",
                "wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY",
            ),
        ]);
        let get = |k: &str| env.get(k).map(|v| (*v).to_owned());
        let c = RemoteConfig::from_lookup("s3://pagefork/x", get).unwrap();
        assert_eq!(c.endpoint.as_deref(), Some("http://127.0.0.1:7480"));
        assert_eq!(c.region, DEFAULT_REGION);
        assert_eq!(
            c.credentials.secret_access_key.expose(),
            "wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY"
        );
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY"),
            "{shown}"
        );
        assert!(!shown.contains("AKIDEXAMPLE"), "{shown}");
        let none = |_: &str| None;
        let e = RemoteConfig::from_lookup("s3://pagefork", none).unwrap_err();
        assert!(e.to_string().contains("AWS_ACCESS_KEY_ID"), "{e}");
    }
}
