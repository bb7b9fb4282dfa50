//! Interprocess events through the driver: made, exported as 64-byte handles, opened from
//! them, recorded and waited on this crate's stream.

use cudarc::driver::sys;

use super::{check, Real};
use crate::cuda::driver::IpcBytes;
use crate::Result;

impl Real {
    pub(crate) fn event_create(&self, dev: u32) -> Result<(u64, IpcBytes)> {
        let _current = self.state(dev)?;
        let mut ev: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32
            | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: writes one event handle; interprocess events need DISABLE_TIMING, set.
        check(unsafe { sys::cuEventCreate(&mut ev, flags) }, "cuEventCreate")?;
        // SAFETY: CUipcEventHandle is 64 plain bytes.
        let mut h: sys::CUipcEventHandle = unsafe { std::mem::zeroed() };
        // SAFETY: ev is the interprocess event made above.
        if let Err(e) = check(unsafe { sys::cuIpcGetEventHandle(&mut h, ev) }, "cuIpcGetEventHandle") {
            // SAFETY: ev was made above and is not used after this.
            unsafe { sys::cuEventDestroy_v2(ev) };
            return Err(e);
        }
        Ok((ev as u64, h.reserved.map(|c| c as u8)))
    }

    /// # Safety
    /// `bytes` must be a handle cuIpcGetEventHandle gave for an event of `dev`, unchanged.
    pub(crate) unsafe fn event_open(&self, dev: u32, bytes: &IpcBytes) -> Result<u64> {
        let _current = self.state(dev)?;
        let h = sys::CUipcEventHandle { reserved: bytes.map(|b| b as std::ffi::c_char) };
        let mut ev: sys::CUevent = std::ptr::null_mut();
        // SAFETY: writes one event. The driver does not check what the handle's bytes say (a
        // forged index makes it read out of bounds): the caller vouches that they are a real
        // handle (this function's contract).
        check(unsafe { sys::cuIpcOpenEventHandle(&mut ev, h) }, "cuIpcOpenEventHandle")?;
        Ok(ev as u64)
    }

    pub(crate) fn event_record(&self, dev: u32, ev: u64) -> Result<()> {
        let st = self.state(dev)?;
        // SAFETY: ev is an event of this process (made or opened here, not destroyed).
        check(unsafe { sys::cuEventRecord(ev as sys::CUevent, st.stream) }, "cuEventRecord")
    }

    pub(crate) fn event_wait(&self, dev: u32, ev: u64) -> Result<()> {
        let st = self.state(dev)?;
        // SAFETY: as in event_record.
        check(unsafe { sys::cuStreamWaitEvent(st.stream, ev as sys::CUevent, 0) }, "cuStreamWaitEvent")
    }

    pub(crate) fn event_synchronize(&self, dev: u32, ev: u64) -> Result<()> {
        let _current = self.state(dev)?;
        // SAFETY: as in event_record.
        check(unsafe { sys::cuEventSynchronize(ev as sys::CUevent) }, "cuEventSynchronize")
    }

    pub(crate) fn event_query(&self, dev: u32, ev: u64) -> Result<bool> {
        let _current = self.state(dev)?;
        // SAFETY: as in event_record.
        let r = unsafe { sys::cuEventQuery(ev as sys::CUevent) };
        if r == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check(r, "cuEventQuery").map(|()| true)
    }

    pub(crate) fn event_destroy(&self, dev: u32, ev: u64) {
        if let Ok(_current) = self.state(dev) {
            // SAFETY: ev is ours and is not used after this; pending records complete first
            // (the driver defers the release).
            unsafe { sys::cuEventDestroy_v2(ev as sys::CUevent) };
        }
    }
}
