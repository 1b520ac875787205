//! Cross-memory attach (`process_vm_readv`/`process_vm_writev`): the kernel copies
//! between this process's memory and a peer's, once.

/// Copies `into.len()` bytes from address `remote` of process `pid` into `into`.
pub fn fetch(pid: u32, remote: u64, into: &mut [u8]) -> std::io::Result<()> {
    // SAFETY: `into` is writable for its length; the kernel checks the peer's side.
    unsafe { cross_memory(pid, into.as_mut_ptr(), remote, into.len(), libc::process_vm_readv) }
}

/// Copies `from` to address `remote` of process `pid`.
pub fn put(pid: u32, remote: u64, from: &[u8]) -> std::io::Result<()> {
    // SAFETY: `from` is readable for its length and process_vm_writev only reads the local
    // side; the kernel checks the peer's side.
    unsafe { cross_memory(pid, from.as_ptr().cast_mut(), remote, from.len(), libc::process_vm_writev) }
}

type CrossMemoryCall = unsafe extern "C" fn(libc::pid_t, *const libc::iovec, libc::c_ulong, *const libc::iovec, libc::c_ulong, libc::c_ulong) -> isize;

/// Moves `len` bytes between `local` and `remote` in process `pid` with `call`, resuming
/// after partial transfers and interruptions.
///
/// # Safety
/// `local..local + len` is valid for what `call` does with it.
unsafe fn cross_memory(pid: u32, local: *mut u8, remote: u64, len: usize, call: CrossMemoryCall) -> std::io::Result<()> {
    let mut done = 0;
    while done < len {
        // SAFETY: done < len, inside the caller's range.
        let l = libc::iovec { iov_base: unsafe { local.add(done) }.cast(), iov_len: len - done };
        let r = libc::iovec { iov_base: (remote as usize + done) as *mut libc::c_void, iov_len: len - done };
        // SAFETY: one valid iovec each side; the local one is valid for `call` (the caller's
        // contract), the kernel checks the remote one.
        match unsafe { call(pid as libc::pid_t, &l, 1, &r, 1, 0) } {
            n if n > 0 => done += n as usize,
            0 => return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "no bytes moved")),
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}
