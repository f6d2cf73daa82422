//! The crate's operations from a shell, for trying a store by hand (the
//! server and `uffdctl` are the real users):
//!
//! ```sh
//! eval "$(scripts/ceph.sh start)"
//! R=target/debug/examples/remote
//! $R push STATE/snapshots/NAME [VOLUME_SNAPSHOT_FILE]
//! $R ls
//! $R pull NAME DIR [VOLUME_FILE]
//! $R rm NAME
//! $R gc
//! ```
//!
//! The location is `$PAGEFORK_REMOTE` (`s3://BUCKET[/PREFIX]`), the
//! endpoint and credentials the `AWS_*` variables.

use std::path::PathBuf;

use pagefork_remote::{PullTarget, PushSource, Remote, RemoteConfig};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let url = std::env::var("PAGEFORK_REMOTE").map_err(|_| "set PAGEFORK_REMOTE")?;
    let remote = Remote::new(RemoteConfig::from_env(&url)?)?;
    let arg = |i: usize| {
        args.get(i)
            .cloned()
            .ok_or("missing argument (see the header)")
    };
    let show = |p: &pagefork_remote::Progress| {
        eprint!(
            "\r{}/{} chunks, {} sent or fetched, {} present   ",
            p.chunks_done, p.chunks_total, p.chunks_moved, p.chunks_present
        );
    };
    match arg(0)?.as_str() {
        "push" => {
            let r = remote
                .push(
                    &PushSource {
                        dir: PathBuf::from(arg(1)?),
                        volume: args.get(2).map(PathBuf::from),
                        working_set: None,
                    },
                    &show,
                )
                .await?;
            eprintln!();
            println!("{r:?}");
        }
        "pull" => {
            let r = remote
                .pull(
                    &arg(1)?,
                    &PullTarget {
                        dir: PathBuf::from(arg(2)?),
                        volume: args.get(3).map(PathBuf::from),
                    },
                    &show,
                )
                .await?;
            eprintln!();
            println!("{r:?}");
        }
        "ls" => {
            for s in remote.list_snapshots().await? {
                println!("{}\t{} bytes", s.name, s.manifest_bytes);
            }
        }
        "rm" => println!("deleted: {}", remote.delete(&arg(1)?).await?),
        "gc" => println!("{:?}", remote.gc().await?),
        other => return Err(format!("unknown command {other} (see the header)").into()),
    }
    Ok(())
}
