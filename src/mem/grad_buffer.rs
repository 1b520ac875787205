//! `GradBuffer`: one flat region cut into named, aligned slots with typed views.

use super::region::{Region, RegionKind};
use crate::dtype::{DType, Element};
use crate::error::{invalid, Result};
use std::collections::BTreeMap;

/// A named slot inside a [`GradBuffer`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slot {
    /// Byte offset in the buffer's region (a multiple of [`SLOT_ALIGN`]).
    pub offset: usize,
    /// Number of elements.
    pub count: usize,
    /// Element type.
    pub dtype: DType,
}

impl Slot {
    /// Size in bytes: `count` elements of `dtype`.
    pub fn bytes(&self) -> usize {
        self.count * self.dtype.size()
    }
}

/// One flat region cut into named, aligned tensor slots. Collectives can run on the whole
/// buffer (a "bucket") or on one slot; the framework writes into the slots in place.
pub struct GradBuffer {
    region: Region,
    slots: BTreeMap<String, Slot>,
    used: usize,
}

/// Alignment of every slot: a cache line, so vector kernels and NIC DMA start aligned.
pub const SLOT_ALIGN: usize = 64;

impl GradBuffer {
    /// Lays out `slots` (name, element count, dtype) in order, each aligned to
    /// [`SLOT_ALIGN`], in a region of the given kind.
    pub fn new(kind: RegionKind, slots: &[(&str, usize, DType)]) -> Result<Self> {
        let mut layout = BTreeMap::new();
        let mut off = 0usize;
        for &(name, count, dtype) in slots {
            let bytes = count.checked_mul(dtype.size()).ok_or_else(|| invalid(format!("slot {name}: size overflows")))?;
            if layout.insert(name.to_string(), Slot { offset: off, count, dtype }).is_some() {
                return Err(invalid(format!("slot {name} declared twice")));
            }
            off = off.checked_add(bytes).and_then(|o| o.checked_next_multiple_of(SLOT_ALIGN)).ok_or_else(|| invalid("buffer size overflows"))?;
        }
        let region = match kind {
            RegionKind::Anonymous => Region::anonymous(off)?,
            RegionKind::HugePages => Region::huge(off)?,
            RegionKind::Shared => Region::shared("gradwire-gradbuffer", off)?,
        };
        Ok(GradBuffer { region, slots: layout, used: off })
    }

    /// The slot named `name`; an error if there is none.
    pub fn slot(&self, name: &str) -> Result<&Slot> {
        self.slots.get(name).ok_or_else(|| invalid(format!("no slot named {name:?}")))
    }

    /// Every slot with its name, in name order.
    pub fn slots(&self) -> impl Iterator<Item = (&str, &Slot)> {
        self.slots.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Bytes covered by the slots (the bucket a whole-buffer collective moves).
    pub fn used_bytes(&self) -> usize {
        self.used
    }

    /// The region that holds all the slots (at least [`GradBuffer::used_bytes`] long).
    pub fn region(&self) -> &Region {
        &self.region
    }

    /// Typed read view of a slot.
    pub fn view<T: Element>(&self, name: &str) -> Result<&[T]> {
        let s = self.checked::<T>(name)?;
        // SAFETY: offset is SLOT_ALIGN-aligned inside the page-aligned region, the range
        // lies inside the region, and every bit pattern is a valid float.
        Ok(unsafe { std::slice::from_raw_parts(self.region.as_ptr().add(s.offset) as *const T, s.count) })
    }

    /// Typed write view of a slot: where the framework puts its gradient.
    pub fn view_mut<T: Element>(&mut self, name: &str) -> Result<&mut [T]> {
        let s = self.checked::<T>(name)?;
        // SAFETY: as in `view`, and `&mut self` makes the borrow exclusive.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.region.as_ptr().add(s.offset) as *mut T, s.count) })
    }

    fn checked<T: Element>(&self, name: &str) -> Result<Slot> {
        let s = self.slot(name)?.clone();
        if s.dtype != T::DTYPE {
            return Err(invalid(format!("slot {name:?} holds {}, not {}", s.dtype.name(), T::DTYPE.name())));
        }
        Ok(s)
    }
}
