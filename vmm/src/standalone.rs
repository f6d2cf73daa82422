//! `vmm standalone`: a VM over anonymous RAM with no server, driven by
//! steps from the command line; prints one JSON line per reply to stdout.
//! Used to develop and test the guest agent on real KVM.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use proto::vmm::{Reply, Request};
use serde_json::{json, Value};
use shared::{GuestRegion, VmState};

use crate::cli::{Extra, StandaloneArgs, Step};
use crate::devices::Disk;
use crate::error::{Error, Result};
use crate::kvm::{Machine, MachineConfig, Prewarmed, VcpuEvent};
use crate::memory::GuestRam;
use crate::ops::{Dispatcher, Flow};

/// How long to wait for the agent to reach its command wait.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

fn summarize(result: &std::result::Result<Reply, proto::vmm::RequestError>) -> Value {
    match result {
        Ok(Reply::Done) => json!({"Ok": "Done"}),
        Ok(Reply::Op(r)) => json!({"Ok": {"Op": {"value": r.value, "elapsed_us": r.elapsed_us}}}),
        Ok(Reply::State(s)) => json!({"Ok": {"State": {
            "vcpus": s.vcpus.len(),
            "devices_bytes": s.devices.len(),
            "agent_result": crate::devices::saved_result(&s.devices),
            "disk_op_in_flight": crate::devices::saved_in_flight(&s.devices),
        }}}),
        Err(e) => json!({"Err": e.to_string()}),
    }
}

struct Session {
    args_vcpus: usize,
    vm_id: u32,
    disk: Option<(std::fs::File, u64)>,
    replies_tx: mpsc::Sender<(usize, std::result::Result<Reply, proto::vmm::RequestError>)>,
}

impl Session {
    fn start(&self, mem: Arc<GuestRam>, start_state: Option<VmState>) -> Result<Dispatcher> {
        let (ready_tx, ready_rx) = mpsc::channel();
        let events = Arc::new(move |e| match e {
            VcpuEvent::Ready => {
                let _ = ready_tx.send(Ok(()));
            }
            VcpuEvent::Fatal(reason) => {
                let _ = ready_tx.send(Err(reason.clone()));
                eprintln!("vmm: fatal: {reason}");
                std::process::exit(1);
            }
        });
        let disk = match &self.disk {
            Some((f, bytes)) => Some(Disk {
                file: f.try_clone().map_err(Error::Disk)?,
                bytes: *bytes,
            }),
            None => None,
        };
        let cfg = MachineConfig {
            vcpus: self.args_vcpus,
            vm_id: self.vm_id,
            disk,
            start_state,
        };
        let pre = Prewarmed::new(self.args_vcpus, None, None, false, false)?;
        let (machine, _) = Machine::start(pre, mem, cfg, events)?;
        match ready_rx.recv_timeout(READY_TIMEOUT) {
            Ok(Ok(())) => {}
            Ok(Err(reason)) => return Err(Error::Guest(reason)),
            Err(_) => {
                return Err(Error::Guest(
                    "the agent did not reach its command wait".into(),
                ))
            }
        }
        println!("{}", json!({"event": "Running"}));
        Ok(Dispatcher::new(machine))
    }

    fn reply_fn(&self, step: usize) -> crate::ops::ReplyFn {
        let tx = self.replies_tx.clone();
        Box::new(move |r| {
            let _ = tx.send((step, r));
        })
    }
}

fn print_reply(
    step: usize,
    request: &Request,
    result: &std::result::Result<Reply, proto::vmm::RequestError>,
) {
    let name = match request {
        Request::Exec(op) => op.name(),
        Request::Pause => "pause",
        Request::Resume => "resume",
        Request::CaptureState => "capture_state",
        Request::Stop => "stop",
        Request::Restore(_) => "restore",
        Request::Discard(_) => "discard",
        Request::Rebase => "rebase",
    };
    println!(
        "{}",
        json!({"step": step, "request": name, "result": summarize(result)})
    );
}

/// Run standalone mode.
pub fn run(args: &StandaloneArgs) -> Result<()> {
    let steps = args
        .steps
        .iter()
        .map(|s| {
            serde_json::from_str::<Step>(s).map_err(|e| Error::Step {
                step: s.clone(),
                source: e,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let size = args
        .memory_mib
        .checked_mul(1 << 20)
        .ok_or(Error::Guest("--memory-mib is too large".into()))?;
    let mem = Arc::new(GuestRam::anonymous(&[GuestRegion {
        guest_phys: 0,
        size,
    }])?);
    let disk = match args.disk_mib {
        Some(mib) => {
            let fd = nix::sys::memfd::memfd_create(
                c"vmm-disk",
                nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC,
            )
            .map_err(|e| Error::Disk(e.into()))?;
            let f = std::fs::File::from(fd);
            f.set_len(mib << 20).map_err(Error::Disk)?;
            Some((f, mib << 20))
        }
        None => None,
    };
    let (replies_tx, replies_rx) = mpsc::channel();
    let session = Session {
        args_vcpus: usize::from(args.vcpus.max(1)),
        vm_id: args.vm_id,
        disk,
        replies_tx,
    };
    let mut dispatcher = session.start(mem.clone(), None)?;
    let mut outstanding: Vec<(usize, Request)> = Vec::new();
    let mut last_state: Option<VmState> = None;

    let collect = |rx: &mpsc::Receiver<_>,
                   outstanding: &mut Vec<(usize, Request)>,
                   want: Option<usize>,
                   last_state: &mut Option<VmState>| {
        while !outstanding.is_empty() {
            let Ok((step, result)) = rx.recv() else { break };
            if let Some(pos) = outstanding.iter().position(|(s, _)| *s == step) {
                let (_, req) = outstanding.remove(pos);
                print_reply(step, &req, &result);
                if let Ok(Reply::State(s)) = result {
                    *last_state = Some(s);
                }
            }
            if want == Some(step) {
                break;
            }
        }
    };

    for (i, step) in steps.into_iter().enumerate() {
        match step {
            Step::Request(req) => {
                outstanding.push((i, req.clone()));
                let flow = dispatcher.handle(req, Vec::new(), session.reply_fn(i));
                collect(&replies_rx, &mut outstanding, Some(i), &mut last_state);
                if flow == Flow::Stop {
                    break;
                }
            }
            Step::Extra(Extra::Async(req)) => {
                outstanding.push((i, req.clone()));
                if dispatcher.handle(req, Vec::new(), session.reply_fn(i)) == Flow::Stop {
                    break;
                }
            }
            Step::Extra(Extra::Wait) => {
                collect(&replies_rx, &mut outstanding, None, &mut last_state)
            }
            Step::Extra(Extra::Sleep(ms)) => std::thread::sleep(Duration::from_millis(ms)),
            Step::Extra(Extra::Restore) => {
                let state = last_state
                    .clone()
                    .ok_or(Error::Guest("Restore needs a CaptureState first".into()))?;
                collect(&replies_rx, &mut outstanding, None, &mut last_state);
                let mem = dispatcher.shutdown();
                dispatcher = session.start(mem, Some(state))?;
            }
        }
    }
    collect(&replies_rx, &mut outstanding, None, &mut last_state);
    dispatcher.shutdown();
    Ok(())
}
