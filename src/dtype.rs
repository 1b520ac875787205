//! Element types and reduction operations, shared by memory views, the wire header and
//! the reduction kernels.

use crate::error::{invalid, Result};
use half::{bf16, f16};

/// Element type of a buffer. The discriminants are the C ABI's and the wire format's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    F32 = 0,
    F64 = 1,
    F16 = 2,
    BF16 = 3,
}

impl DType {
    pub const ALL: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 => 8,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// Short name as used by the CLI and in messages.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
        }
    }

    /// Decodes a wire/C value.
    pub fn from_u8(v: u8) -> Result<Self> {
        Ok(match v {
            0 => DType::F32,
            1 => DType::F64,
            2 => DType::F16,
            3 => DType::BF16,
            _ => return Err(invalid(format!("unknown dtype code {v}"))),
        })
    }

    /// Machine epsilon: the unit of relative error for one rounding in this type.
    pub fn epsilon(self) -> f64 {
        match self {
            DType::F32 => f32::EPSILON as f64,
            DType::F64 => f64::EPSILON,
            DType::F16 => f16::EPSILON.to_f64(),
            DType::BF16 => bf16::EPSILON.to_f64(),
        }
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "float32" | "f32" | "float" => Ok(DType::F32),
            "float64" | "f64" | "double" => Ok(DType::F64),
            "float16" | "f16" | "half" => Ok(DType::F16),
            "bfloat16" | "bf16" => Ok(DType::BF16),
            _ => Err(format!("unknown dtype {s:?} (float32, float64, float16, bfloat16)")),
        }
    }
}

/// Reduction operation. The discriminants are the C ABI's and the wire format's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    Sum = 0,
    Avg = 1,
    Min = 2,
    Max = 3,
}

impl ReduceOp {
    pub const ALL: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max];

    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
        }
    }

    /// Decodes a wire/C value.
    pub fn from_u8(v: u8) -> Result<Self> {
        Ok(match v {
            0 => ReduceOp::Sum,
            1 => ReduceOp::Avg,
            2 => ReduceOp::Min,
            3 => ReduceOp::Max,
            _ => return Err(invalid(format!("unknown reduce op code {v}"))),
        })
    }
}

impl std::str::FromStr for ReduceOp {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "sum" => Ok(ReduceOp::Sum),
            "avg" | "mean" => Ok(ReduceOp::Avg),
            "min" => Ok(ReduceOp::Min),
            "max" => Ok(ReduceOp::Max),
            _ => Err(format!("unknown op {s:?} (sum, avg, min, max)")),
        }
    }
}

/// A Rust element type gradwire can reduce. Sealed to the four wire types.
pub trait Element: Copy + Send + Sync + 'static + private::Sealed {
    const DTYPE: DType;
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
}

mod private {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
}
impl Element for f64 {
    const DTYPE: DType = DType::F64;
    fn to_f64(self) -> f64 {
        self
    }
    fn from_f64(v: f64) -> Self {
        v
    }
}
impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
}
impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
}
