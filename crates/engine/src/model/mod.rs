//! Model architectures (backend-agnostic forward passes).
