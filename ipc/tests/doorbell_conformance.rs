//! One conformance suite for the exchange and its doorbell, run for each wait strategy
//! (`spin`, `spin_then_futex`), in-process and across processes.

mod common;

use std::sync::atomic::Ordering;
use std::thread;
use std::time::{Duration, Instant};

use thaw_ipc::*;

const FD_VAR: &str = "THAW_EXCHANGE_FD";
/// A job with this rank makes the child worker sleep before computing (forces the engine to
/// park on the result word).
const SLOW_RANK: u32 = 999;

fn cfg() -> ExchangeConfig {
    ExchangeConfig {
        max_workers: 3,
        max_jobs: 8,
        max_inputs: 2,
        max_rows: 16,
        max_d_in: 8,
        max_d_out: 12,
    }
}

fn strategy_named(name: &str) -> WaitStrategy {
    match name {
        "spin" => WaitStrategy::spin(),
        _ => WaitStrategy::spin_then_futex(),
    }
}

fn name_of(s: WaitStrategy) -> &'static str {
    if s.parks() {
        "futex"
    } else {
        "spin"
    }
}

/// Same strategy, but a parked waiter is never woken by the safety-net timeout within a test.
fn long_cap(s: WaitStrategy) -> WaitStrategy {
    match s {
        WaitStrategy::SpinThenFutex { spins, .. } => WaitStrategy::SpinThenFutex {
            spins,
            sleep_cap: Duration::from_secs(30),
        },
        s => s,
    }
}

fn peer(ex: &Exchange) -> Exchange {
    let fd = ex.segment().try_clone_fd().unwrap();
    Exchange::open(Segment::open_fd(fd, SegmentKind::Exchange).unwrap()).unwrap()
}

fn delta(x: f32, module: Module, seq: StepSeq) -> f32 {
    x * (module.index() + 1) as f32 + seq.0 as f32 * 0.5
}

fn input_value(seq: StepSeq, input: u32, row: usize, col: usize) -> f32 {
    (seq.0 as f32) * 0.25 + input as f32 * 100.0 + row as f32 * 8.0 + col as f32
}

/// The worker's computation: Δ[r, c] = x[r, c % d_in] · (module + 1) + seq / 2.
fn compute(port: &mut WorkerPort, seq: StepSeq) {
    let d_in = port.exchange().config().max_d_in as usize;
    let d_out = port.exchange().config().max_d_out as usize;
    let jobs: Vec<Job> = port.my_jobs().collect();
    for job in jobs {
        if job.rank == SLOW_RANK {
            thread::sleep(Duration::from_millis(80));
        }
        for m in job.modules.iter() {
            let (x, y) = port.job_io(&job, m).unwrap();
            for r in 0..job.row_count as usize {
                for c in 0..d_out {
                    y[r * d_out + c] = delta(x[r * d_in + c % d_in], m, seq);
                }
            }
        }
    }
}

fn run_worker(strategy: WaitStrategy, id: u32) {
    let seg = Segment::from_inherited_env(FD_VAR, SegmentKind::Exchange).unwrap();
    let mut port = WorkerPort::attach(Exchange::open(seg).unwrap(), WorkerId(id)).unwrap();
    let mut idle_since = Instant::now();
    loop {
        match port.wait_step(strategy, Some(Instant::now() + Duration::from_millis(200))) {
            WaitOutcome::Step(seq) => {
                compute(&mut port, seq);
                port.complete();
                idle_since = Instant::now();
            }
            WaitOutcome::Shutdown => return,
            WaitOutcome::TimedOut => {
                port.beat();
                assert!(
                    idle_since.elapsed() < Duration::from_secs(30),
                    "orphaned worker"
                );
            }
        }
    }
}

#[test]
fn child_entry() {
    let Some(role) = common::role() else { return };
    let parts: Vec<&str> = role.split(':').collect();
    match parts.as_slice() {
        ["worker", s, id] => run_worker(strategy_named(s), id.parse().unwrap()),
        ["expect-no-fd"] => {
            let err = Segment::from_inherited_env(FD_VAR, SegmentKind::Exchange).unwrap_err();
            assert!(
                matches!(err, IpcError::Sys { .. } | IpcError::NoInheritedFd(_)),
                "{err}"
            );
        }
        other => panic!("unknown role {other:?}"),
    }
    std::process::exit(0);
}

/// Writes inputs and jobs for `seq` on `workers` workers: each worker takes a disjoint row
/// range for {Q, K} from input 0 and for {O} from input 1.
fn plan(ex: &mut Exchange, seq: StepSeq, workers: u32, slow: Option<u32>) -> Vec<Job> {
    let c = *ex.config();
    for input in 0..2 {
        let rows = ex.input_mut(input, 0..c.max_rows).unwrap();
        for r in 0..c.max_rows as usize {
            for k in 0..c.max_d_in as usize {
                rows[r * c.max_d_in as usize + k] = input_value(seq, input, r, k);
            }
        }
    }
    let per = c.max_rows / workers;
    let mut jobs = Vec::new();
    for w in 0..workers {
        let base = Job {
            worker: WorkerId(w),
            row_start: w * per,
            row_count: per,
            rank: if slow == Some(w) { SLOW_RANK } else { 8 },
            scale: 1.0,
            ..bytemuck::Zeroable::zeroed()
        };
        jobs.push(Job {
            modules: [Module::Q, Module::K].into_iter().collect(),
            input: 0,
            ..base
        });
        jobs.push(Job {
            modules: ModuleMask::EMPTY.with(Module::O),
            input: 1,
            ..base
        });
    }
    ex.set_jobs(&jobs).unwrap();
    jobs
}

fn verify(ex: &Exchange, seq: StepSeq, jobs: &[Job]) {
    let c = *ex.config();
    for job in jobs {
        for m in job.modules.iter() {
            let y = ex.output(m, job.rows()).unwrap();
            for r in 0..job.row_count as usize {
                let row = job.row_start as usize + r;
                for k in 0..c.max_d_out as usize {
                    let x = input_value(seq, job.input, row, k % c.max_d_in as usize);
                    assert_eq!(
                        y[r * c.max_d_out as usize + k],
                        delta(x, m, seq),
                        "step {seq:?} {m:?} row {row}"
                    );
                }
            }
        }
    }
}

fn in_process_round_trips(s: WaitStrategy) {
    let mut ex = Exchange::create(cfg()).unwrap();
    let workers: Vec<_> = (0..2)
        .map(|w| {
            let mut port = WorkerPort::attach(peer(&ex), WorkerId(w)).unwrap();
            thread::spawn(move || loop {
                match port.wait_step(s, None) {
                    WaitOutcome::Step(seq) => {
                        compute(&mut port, seq);
                        port.complete();
                    }
                    WaitOutcome::Shutdown => return,
                    WaitOutcome::TimedOut => unreachable!("no deadline"),
                }
            })
        })
        .collect();
    let mut seq = StepSeq(0);
    for i in 0..200 {
        seq = seq.next();
        let jobs = plan(&mut ex, seq, 2, None);
        if i % 2 == 0 {
            ex.arm();
        }
        ex.post_step(seq).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        ex.wait_results(seq, WorkerMask::first(2), s, deadline)
            .unwrap();
        ex.disarm();
        verify(&ex, seq, &jobs);
    }
    ex.shutdown();
    for t in workers {
        t.join().unwrap();
    }
}

fn cross_process_round_trips(s: WaitStrategy) {
    let mut ex = Exchange::create(cfg()).unwrap();
    let children: Vec<_> = (0..2)
        .map(|w| {
            common::spawn_child(
                &format!("worker:{}:{w}", name_of(s)),
                &[(ex.segment(), FD_VAR)],
                &[],
            )
        })
        .collect();
    let pids: Vec<u32> = children.iter().map(|c| c.id()).collect();
    let mut seq = StepSeq(0);
    let mut slow_rounds = 0;
    for i in 0..300u32 {
        seq = seq.next();
        // Every 50th step: leave the workers idle long enough to park (futex strategy), and
        // make one of them slow so the engine parks on its result word.
        let pause = i % 50 == 25;
        if pause {
            thread::sleep(Duration::from_millis(60));
            slow_rounds += 1;
        }
        let jobs = plan(&mut ex, seq, 2, pause.then_some(i % 2));
        let armed = i % 3 == 0 && !pause;
        if armed {
            ex.arm();
        }
        ex.post_step(seq).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        ex.wait_results(seq, WorkerMask::first(2), s, deadline)
            .unwrap_or_else(|late| panic!("step {seq:?}: workers {late:?} missed the deadline"));
        if armed {
            ex.disarm();
        }
        verify(&ex, seq, &jobs);
    }
    assert!(slow_rounds > 0);
    for (w, pid) in pids.iter().enumerate() {
        let st = ex.worker_status(WorkerId(w as u32)).unwrap();
        assert_eq!(st.pid, *pid, "pid slot of worker {w}");
        assert!(st.heartbeat >= 1);
        assert_eq!(st.result, seq);
    }
    ex.shutdown();
    for c in children {
        common::expect_success(c, Duration::from_secs(20));
    }
}

fn parked_waiter_is_woken(s: WaitStrategy) {
    let s = long_cap(s);
    let mut ex = Exchange::create(cfg()).unwrap();
    let mut port = WorkerPort::attach(peer(&ex), WorkerId(0)).unwrap();
    let waiter = thread::spawn(move || {
        let out = port.wait_step(s, Some(Instant::now() + Duration::from_secs(20)));
        (out, Instant::now())
    });
    let sleepers = || {
        ex.segment()
            .atomic_u32(ex.layout().sleepers)
            .load(Ordering::SeqCst)
    };
    if s.parks() {
        // Parks after its spins: wait for it (on a loaded machine the waiter thread may not
        // run for a while) rather than look once after a fixed sleep.
        let until = Instant::now() + Duration::from_secs(20);
        while sleepers() != 1 {
            assert!(
                Instant::now() < until,
                "an idle, unarmed waiter should be parked in the futex (sleepers {})",
                sleepers()
            );
            thread::sleep(Duration::from_millis(1));
        }
    } else {
        thread::sleep(Duration::from_millis(150));
        assert_eq!(sleepers(), 0, "a spinning waiter never parks");
    }
    ex.set_jobs(&[]).unwrap();
    let rung = Instant::now();
    ex.post_step(StepSeq(1)).unwrap();
    let (out, woke) = waiter.join().unwrap();
    assert_eq!(out, WaitOutcome::Step(StepSeq(1)));
    let latency = woke.duration_since(rung);
    assert!(latency < Duration::from_secs(5), "woken after {latency:?}");
}

fn deadline_returns_laggards(s: WaitStrategy) {
    let mut ex = Exchange::create(cfg()).unwrap();
    let mut ports: Vec<_> = (0..3)
        .map(|w| WorkerPort::attach(peer(&ex), WorkerId(w)).unwrap())
        .collect();
    ex.set_jobs(&[]).unwrap();
    ex.post_step(StepSeq(1)).unwrap();
    for p in &mut ports {
        assert_eq!(p.wait_step(s, None), WaitOutcome::Step(StepSeq(1)));
    }
    ports[0].complete();
    ports[2].complete();
    let start = Instant::now();
    let late = ex
        .wait_results(
            StepSeq(1),
            WorkerMask::first(3),
            s,
            start + Duration::from_millis(100),
        )
        .unwrap_err();
    let took = start.elapsed();
    assert_eq!(late, WorkerMask::default().with(WorkerId(1)));
    assert!(
        took >= Duration::from_millis(100) && took < Duration::from_secs(5),
        "{took:?}"
    );
    // Still in flight: the engine may not touch the rows until it abandons the step.
    assert!(ex.set_jobs(&[]).is_err());
    ports[1].complete();
    ex.wait_results(
        StepSeq(1),
        WorkerMask::first(3),
        s,
        Instant::now() + Duration::from_secs(5),
    )
    .unwrap();
    ex.set_jobs(&[]).unwrap();
}

fn armed_waiter_sees_device_store(s: WaitStrategy) {
    let s = long_cap(s);
    let mut ex = Exchange::create(cfg()).unwrap();
    let mut port = WorkerPort::attach(peer(&ex), WorkerId(0)).unwrap();
    ex.set_jobs(&[]).unwrap();
    ex.arm();
    ex.device_step_pending(StepSeq(1)).unwrap();
    let waiter =
        thread::spawn(move || port.wait_step(s, Some(Instant::now() + Duration::from_secs(20))));
    thread::sleep(Duration::from_millis(50));
    // What the GPU's copy-and-signal kernel does: a plain store, no futex wake.
    let stored = Instant::now();
    ex.seq_word().store(1, Ordering::Release);
    assert_eq!(waiter.join().unwrap(), WaitOutcome::Step(StepSeq(1)));
    let latency = stored.elapsed();
    assert!(
        latency < Duration::from_secs(10),
        "armed waiter noticed a device store after {latency:?}"
    );
    ex.disarm();
}

fn shutdown_wakes_waiters(s: WaitStrategy) {
    let s = long_cap(s);
    let ex = Exchange::create(cfg()).unwrap();
    let waiters: Vec<_> = (0..2)
        .map(|w| {
            let mut port = WorkerPort::attach(peer(&ex), WorkerId(w)).unwrap();
            thread::spawn(move || port.wait_step(s, Some(Instant::now() + Duration::from_secs(20))))
        })
        .collect();
    thread::sleep(Duration::from_millis(100));
    ex.shutdown();
    for w in waiters {
        assert_eq!(w.join().unwrap(), WaitOutcome::Shutdown);
    }
}

fn idle_waiter_cpu(s: WaitStrategy) {
    let ex = Exchange::create(cfg()).unwrap();
    let mut port = WorkerPort::attach(peer(&ex), WorkerId(0)).unwrap();
    let wait = Duration::from_millis(400);
    let cpu = thread::spawn(move || {
        let t0 = thread_cpu_time();
        assert_eq!(
            port.wait_step(s, Some(Instant::now() + wait)),
            WaitOutcome::TimedOut
        );
        thread_cpu_time() - t0
    })
    .join()
    .unwrap();
    println!(
        "{}: idle unarmed wait of {wait:?} used {cpu:?} of CPU",
        name_of(s)
    );
    if s.parks() {
        assert!(
            cpu < Duration::from_millis(40),
            "unarmed futex waiter burned {cpu:?}"
        );
    }
    drop(ex);
}

macro_rules! conformance {
    ($name:ident, $strategy:expr) => {
        mod $name {
            use super::*;
            const S: WaitStrategy = $strategy;

            #[test]
            fn in_process_round_trips() {
                super::in_process_round_trips(S);
            }
            #[test]
            fn cross_process_round_trips() {
                super::cross_process_round_trips(S);
            }
            #[test]
            fn parked_waiter_is_woken() {
                super::parked_waiter_is_woken(S);
            }
            #[test]
            fn deadline_returns_laggards() {
                super::deadline_returns_laggards(S);
            }
            #[test]
            fn armed_waiter_sees_device_store() {
                super::armed_waiter_sees_device_store(S);
            }
            #[test]
            fn shutdown_wakes_waiters() {
                super::shutdown_wakes_waiters(S);
            }
            #[test]
            fn idle_waiter_cpu() {
                super::idle_waiter_cpu(S);
            }
        }
    };
}

conformance!(spin, WaitStrategy::spin());
conformance!(spin_then_futex, WaitStrategy::spin_then_futex());

#[test]
fn fd_is_not_inherited_without_inherit_into() {
    let ex = Exchange::create(cfg()).unwrap();
    let raw = std::os::fd::AsRawFd::as_raw_fd(&std::os::fd::AsFd::as_fd(ex.segment()));
    // The number is passed, but the fd itself is close-on-exec: the child must not find it.
    let child = common::spawn_child("expect-no-fd", &[], &[(FD_VAR, raw.to_string())]);
    common::expect_success(child, Duration::from_secs(20));
}
