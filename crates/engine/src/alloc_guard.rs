//! A memory and time bound for work that untrusted input drives (chat templates): the work
//! runs on a thread of its own, [`run_bounded`] waits for it within a time limit, and
//! [`GuardedAlloc`], when a binary installs it as the global allocator, charges that
//! thread's allocations to a budget.
//!
//! Rust's allocator interface cannot fail an allocation gracefully (returning null aborts
//! the process, unwinding out of it is undefined), so an allocation that would pass the
//! budget is never made: the allocator raises the thread's over-budget flag and parks the
//! thread for good. The caller sees the flag and returns [`Stopped::Memory`]. The parked
//! thread keeps what it had allocated, at most the budget, until the process exits: a
//! long-running process leaks up to one budget per hostile input it meets.
//!
//! Without `GuardedAlloc` installed (a library user's own allocator) the work still runs
//! on its own thread under the time limit, but memory is not bounded:
//! [`GuardedAlloc::installed`] tells which. Install it with
//!
//! ```ignore
//! #[global_allocator]
//! static ALLOC: ferrolm::alloc_guard::GuardedAlloc = ferrolm::alloc_guard::GuardedAlloc;
//! ```
//!
//! The cost for a thread with no budget armed is one thread-local read per allocation and
//! deallocation. The budget counts the thread's net allocation: what it frees (including
//! blocks other threads allocated) is given back. The thread-local is `const`-initialized
//! and needs no destructor, so reading it inside the allocator never allocates (true on
//! every target with native thread-locals: Linux, macOS, Windows).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// The global allocator that enforces [`run_bounded`]'s memory budget: `System`'s, plus
/// the accounting of threads that have a budget armed.
pub struct GuardedAlloc;

/// A thread's budget: `over` is null when none is armed, else the flag raised when the
/// thread passes `limit` bytes (it holds one count of an `Arc<AtomicBool>`).
struct Budget {
    over: Cell<*const AtomicBool>,
    used: Cell<usize>,
    limit: Cell<usize>,
}

thread_local! {
    static BUDGET: Budget = const {
        Budget { over: Cell::new(ptr::null()), used: Cell::new(0), limit: Cell::new(0) }
    };
}

/// Count `size` more bytes against the thread's budget, if one is armed; past it, never
/// return (see [`over_budget`]).
#[inline]
fn charge(size: usize) {
    let _ = BUDGET.try_with(|b| {
        let over = b.over.get();
        if over.is_null() {
            return;
        }
        match b.used.get().checked_add(size) {
            Some(n) if n <= b.limit.get() => b.used.set(n),
            // Parking inside the panic machinery could hold stderr's lock for good: let a
            // panicking thread finish unwinding instead.
            _ if std::thread::panicking() => b.used.set(b.used.get().saturating_add(size)),
            _ => over_budget(b, over),
        }
    });
}

/// Give `size` bytes back to the thread's budget, if one is armed.
#[inline]
fn credit(size: usize) {
    let _ = BUDGET.try_with(|b| {
        if !b.over.get().is_null() {
            b.used.set(b.used.get().saturating_sub(size));
        }
    });
}

/// Raise the thread's over-budget flag and park the thread for good (an allocator may not
/// unwind, and failing the allocation would abort the process). Allocates nothing.
#[cold]
fn over_budget(b: &Budget, over: *const AtomicBool) -> ! {
    b.over.set(ptr::null());
    // SAFETY: an armed budget holds a count of the Arc that owns the flag (`arm`); disarmed
    // here without releasing it, the flag lives as long as the process.
    unsafe { (*over).store(true, Ordering::Release) };
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

// SAFETY: every call is passed to `System` unchanged; the accounting around it allocates
// nothing and does not unwind.
unsafe impl GlobalAlloc for GuardedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        charge(layout.size());
        let p = System.alloc(layout);
        if p.is_null() {
            credit(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        charge(layout.size());
        let p = System.alloc_zeroed(layout);
        if p.is_null() {
            credit(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        credit(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let old = layout.size();
        let grow = new_size.saturating_sub(old);
        charge(grow);
        let p = System.realloc(ptr, layout, new_size);
        match (p.is_null(), grow > 0) {
            (true, _) => credit(grow),
            (false, false) => credit(old - new_size),
            (false, true) => {}
        }
        p
    }
}

impl GuardedAlloc {
    /// Whether `GuardedAlloc` is this process's global allocator, i.e. whether
    /// [`run_bounded`] bounds memory. Probes with one small allocation.
    pub fn installed() -> bool {
        let flag = Arc::new(AtomicBool::new(false));
        let armed = arm(usize::MAX, &flag);
        let probe = std::hint::black_box(Box::new(0u64));
        let used = BUDGET.with(|b| b.used.get());
        drop(probe);
        drop(armed);
        used > 0
    }
}

/// A budget armed on the current thread; dropping it restores the one before.
struct Armed {
    prev: (*const AtomicBool, usize, usize),
}

fn arm(limit: usize, over: &Arc<AtomicBool>) -> Armed {
    let flag = Arc::into_raw(Arc::clone(over));
    BUDGET.with(|b| Armed { prev: (b.over.replace(flag), b.used.replace(0), b.limit.replace(limit)) })
}

impl Drop for Armed {
    fn drop(&mut self) {
        let (over, used, limit) = self.prev;
        let flag = BUDGET.with(|b| {
            b.used.set(used);
            b.limit.set(limit);
            b.over.replace(over)
        });
        if !flag.is_null() {
            // SAFETY: `arm` stored this pointer from `Arc::into_raw`; it is released once.
            drop(unsafe { Arc::from_raw(flag) });
        }
    }
}

/// The limits of one [`run_bounded`] call.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Bytes the work's thread may hold at once (enforced only with [`GuardedAlloc`]).
    pub memory: usize,
    /// Wall-clock time the caller waits for the result.
    pub time: Duration,
}

/// Why [`run_bounded`] returned no result.
#[derive(Debug)]
pub enum Stopped {
    /// The work would have held more than this many bytes; its thread is parked for good.
    Memory(usize),
    /// No result within this time; the thread is left to finish (or park) on its own.
    Time(Duration),
    /// The work panicked.
    Panicked,
    /// The thread could not be started.
    NoThread(std::io::Error),
}

impl std::fmt::Display for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stopped::Memory(n) if n % (1 << 20) == 0 => write!(f, "used more than {} MiB", n >> 20),
            Stopped::Memory(n) => write!(f, "used more than {n} bytes"),
            Stopped::Time(t) => write!(f, "took more than {} s", t.as_secs_f64()),
            Stopped::Panicked => write!(f, "panicked"),
            Stopped::NoThread(e) => write!(f, "could not start a thread: {e}"),
        }
    }
}

/// Stack of the work's thread: chat templates recurse (up to minijinja's depth limit).
const STACK: usize = 8 << 20;
/// How often the caller looks at the over-budget flag and the clock.
const POLL: Duration = Duration::from_millis(5);

/// `f` on a new thread with `limits.memory` bytes armed (see the module docs), its result
/// awaited for at most `limits.time`.
pub fn run_bounded<T: Send + 'static>(limits: Limits, f: impl FnOnce() -> T + Send + 'static) -> Result<T, Stopped> {
    let over = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&over);
    // Room for the one message, made here: sending allocates nothing on the work's thread.
    let (tx, rx) = mpsc::sync_channel(1);
    let work = move || {
        let armed = arm(limits.memory, &flag);
        let r = catch_unwind(AssertUnwindSafe(f)).map_err(drop);
        drop(armed);
        let _ = tx.send(r);
    };
    std::thread::Builder::new()
        .name("ferrolm-bounded".into())
        .stack_size(STACK)
        .spawn(work)
        .map_err(Stopped::NoThread)?;
    let start = Instant::now();
    loop {
        match rx.recv_timeout(POLL) {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(())) | Err(mpsc::RecvTimeoutError::Disconnected) => return Err(Stopped::Panicked),
            Err(mpsc::RecvTimeoutError::Timeout) if over.load(Ordering::Acquire) => {
                return Err(Stopped::Memory(limits.memory))
            }
            Err(mpsc::RecvTimeoutError::Timeout) if start.elapsed() >= limits.time => {
                return Err(Stopped::Time(limits.time))
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    fn limits(memory: usize, ms: u64) -> Limits {
        Limits { memory, time: Duration::from_millis(ms) }
    }

    /// The lib's test binary installs GuardedAlloc (lib.rs).
    #[test]
    fn installed_in_the_test_binary() {
        assert!(GuardedAlloc::installed());
        assert!(run_bounded(limits(MIB, 10_000), GuardedAlloc::installed).unwrap());
    }

    /// Past the budget, by one allocation or by growing one (realloc), the work stops with
    /// Memory; within it, and freeing as it goes, it finishes.
    #[test]
    fn memory_past_the_budget_stops_the_work() {
        let t = Instant::now();
        // black_box: an allocation whose contents are never read may be optimized away.
        let big = run_bounded(limits(4 * MIB, 30_000), || std::hint::black_box(vec![1u8; 8 * MIB]).len());
        assert!(matches!(big, Err(Stopped::Memory(m)) if m == 4 * MIB), "{big:?}");
        let grown = run_bounded(limits(4 * MIB, 30_000), || (0..8 * MIB).map(|i| i as u8).collect::<Vec<u8>>().len());
        assert!(matches!(grown, Err(Stopped::Memory(_))), "{grown:?}");
        assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
        let churn = run_bounded(limits(4 * MIB, 30_000), || {
            (0..100).map(|_| std::hint::black_box(vec![1u8; 2 * MIB]).len()).sum::<usize>()
        });
        assert_eq!(churn.unwrap(), 200 * MIB);
        assert_eq!(Stopped::Memory(256 * MIB).to_string(), "used more than 256 MiB");
    }

    #[test]
    fn time_and_panics_are_errors() {
        let slow = run_bounded(limits(MIB, 50), || std::thread::sleep(Duration::from_secs(3)));
        assert!(matches!(slow, Err(Stopped::Time(_))), "{slow:?}");
        let panics = run_bounded(limits(MIB, 10_000), || -> u8 { panic!("on purpose") });
        assert!(matches!(panics, Err(Stopped::Panicked)), "{panics:?}");
        assert_eq!(run_bounded(limits(MIB, 10_000), || 7).unwrap(), 7);
    }
}
