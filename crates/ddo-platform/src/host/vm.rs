//! The Linux primitives behind the host backend's virtual memory.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use ddo_core::{DeviceError, PlatformError};

fn os_error(call: &str) -> DeviceError {
    let e = std::io::Error::last_os_error();
    let oom = matches!(e.raw_os_error(), Some(libc::ENOMEM));
    if oom {
        return DeviceError::OutOfMemory { requested: 0 };
    }
    DeviceError::Platform(PlatformError::new(call, e.to_string()).with_source(e))
}

pub(super) fn page_size() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(size).unwrap_or(4096)
}

/// An inaccessible span of addresses (`PROT_NONE`, no swap reserved), aligned to `align`.
#[derive(Debug)]
pub(super) struct ReservedSpan {
    /// The whole mapping made (with alignment slack), to unmap on drop.
    raw: u64,
    raw_len: u64,
    start: u64,
}

impl ReservedSpan {
    pub(super) fn new(len: u64, align: u64) -> Result<ReservedSpan, DeviceError> {
        let raw_len = len + align;
        // SAFETY: an anonymous PROT_NONE mapping at an address the kernel picks; no memory is
        // touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                raw_len as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_error("mmap (reserve)"));
        }
        let raw = p as u64;
        let start = raw.div_ceil(align) * align;
        Ok(ReservedSpan { raw, raw_len, start })
    }

    pub(super) fn start(&self) -> u64 {
        self.start
    }
}

impl Drop for ReservedSpan {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the span this value mapped; nothing else lives there (mappings
        // of backings were placed inside it with MAP_FIXED and go with it).
        unsafe { libc::munmap(self.raw as *mut libc::c_void, self.raw_len as usize) };
    }
}

/// Physical memory: a memfd of `len` bytes.
#[derive(Debug)]
pub(super) struct Backing {
    fd: OwnedFd,
    len: u64,
}

impl Backing {
    pub(super) fn new(len: u64) -> Result<Backing, DeviceError> {
        // SAFETY: the name is a valid NUL-terminated string.
        let fd = unsafe { libc::memfd_create(c"ddo-backing".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(os_error("memfd_create"));
        }
        // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: a valid descriptor.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(os_error("ftruncate"));
        }
        Ok(Backing { fd, len })
    }

    /// Maps the whole backing read/write at `addr` (inside a reservation, checked by the caller).
    pub(super) fn map_at(&self, addr: u64) -> Result<(), DeviceError> {
        // SAFETY: `addr..addr+len` lies inside a PROT_NONE reservation owned by this backend
        // (checked by the caller), so MAP_FIXED replaces only our own inaccessible pages.
        let p = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                self.len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                self.fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_error("mmap (map backing)"));
        }
        Ok(())
    }
}

/// Puts `addr..addr+len` back to an inaccessible reservation.
pub(super) fn protect_none(addr: u64, len: u64) -> Result<(), DeviceError> {
    // SAFETY: the range is one of our mappings inside our reservation (checked by the caller);
    // replacing it with PROT_NONE anonymous memory drops the backing's pages from it.
    let p = unsafe {
        libc::mmap(
            addr as *mut libc::c_void,
            len as usize,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(os_error("mmap (unmap backing)"));
    }
    Ok(())
}
