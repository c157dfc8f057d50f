//! Keeping the vDSO's time page true: the guest TSC runs on while the guest
//! is parked, and a new VM starts a new TSC; resample before running.

use forkbox_vmm::Vm;

pub fn refresh(vm: &mut Vm, enabled: bool) -> Result<(), forkbox_vmm::VmmError> {
    if !enabled {
        return Ok(());
    }
    let tsc = vm.guest_tsc()?;
    let data = forkbox_vmm::vdso::VvarData::sample(tsc, vm.tsc_khz());
    vm.mem_mut().write(forkbox_vmm::layout::VVAR_PAGE, data.as_bytes())?;
    Ok(())
}
