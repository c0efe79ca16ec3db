//! Inputs that are not regular files (a FIFO, which blocks on open, a device such as
//! /dev/zero, which never ends, a directory) are refused at once with an error naming
//! the path, as models, model-directory files and text inputs; text inputs past their size
//! limit are refused too. Each case runs on a thread with a deadline, so a regression
//! fails instead of hanging the suite.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

/// `f` on a thread; its result within 20 s, or a failure naming `case`.
fn within_deadline<T: Send + 'static>(case: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(20))
        .unwrap_or_else(|_| panic!("{case}: no answer in 20 s (blocked or endless read)"))
}

fn fifo(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    let ok = std::process::Command::new("mkfifo").arg(&p).status().is_ok_and(|s| s.success());
    assert!(ok, "mkfifo {}", p.display());
    p
}

fn load_err(case: &str, path: PathBuf) -> String {
    within_deadline(case, move || ferrolm::formats::load(&path, false).map(|_| ())).expect_err(case).to_string()
}

#[test]
fn non_regular_model_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let err = load_err("/dev/zero as a model", PathBuf::from("/dev/zero"));
    assert!(err.contains("/dev/zero") && err.contains("not a regular file"), "{err}");
    let err = load_err("a FIFO as a model", fifo(dir.path(), "model.gguf"));
    assert!(err.contains("model.gguf") && err.contains("not a regular file"), "{err}");
    // A model directory whose config.json is a FIFO.
    let m = dir.path().join("hf");
    std::fs::create_dir(&m).unwrap();
    fifo(&m, "config.json");
    let err = load_err("a FIFO config.json", m.clone());
    assert!(err.contains("config.json") && err.contains("not a regular file"), "{err}");
    // ... or whose config.json is a directory.
    std::fs::remove_file(m.join("config.json")).unwrap();
    std::fs::create_dir(m.join("config.json")).unwrap();
    let err = load_err("a directory config.json", m);
    assert!(err.contains("config.json") && err.contains("a directory"), "{err}");
}

#[test]
fn text_inputs_are_regular_and_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let err = within_deadline("/dev/zero as text", || ferrolm::files::read_text(Path::new("/dev/zero")))
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a regular file"), "{err}");
    let f = fifo(dir.path(), "prompt.txt");
    let err = within_deadline("a FIFO as text", move || ferrolm::files::read_text(&f)).unwrap_err().to_string();
    assert!(err.contains("not a regular file"), "{err}");
    let big = dir.path().join("big.txt");
    std::fs::write(&big, vec![b'a'; 4096]).unwrap();
    let err = ferrolm::files::read(&big, 1024).unwrap_err().to_string();
    assert!(err.contains("4096 bytes"), "{err}");
    assert_eq!(ferrolm::files::read(&big, 4096).unwrap().len(), 4096);
    assert_eq!(ferrolm::files::read_text_if_present(&dir.path().join("absent.json")).unwrap(), None);
}
