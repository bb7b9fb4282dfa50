//! Element types: [`DType`] names them, [`Element`] ties them to Rust scalar types.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The element type of a tensor. Names follow torch (`float32`) and safetensors (`F32`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    /// `bool`, one byte, 0 or 1.
    Bool,
    /// `uint8`.
    U8,
    /// `int8`.
    I8,
    /// `int16`.
    I16,
    /// `int32`.
    I32,
    /// `int64`.
    I64,
    /// `float16` (IEEE half).
    F16,
    /// `bfloat16`.
    BF16,
    /// `float32`.
    F32,
    /// `float64`.
    F64,
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 10] = [
        DType::Bool,
        DType::U8,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
    ];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 => 1,
            DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// The name torch gives it (`float32`).
    pub const fn torch_name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F64 => "float64",
        }
    }

    /// The name safetensors gives it (`F32`).
    pub const fn safetensors_name(self) -> &'static str {
        match self {
            DType::Bool => "BOOL",
            DType::U8 => "U8",
            DType::I8 => "I8",
            DType::I16 => "I16",
            DType::I32 => "I32",
            DType::I64 => "I64",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::F32 => "F32",
            DType::F64 => "F64",
        }
    }

    /// Whether the type is a floating-point type.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }
}

/// Shows the torch name; `{:#}` shows the safetensors name.
impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if f.alternate() {
            f.write_str(self.safetensors_name())
        } else {
            f.write_str(self.torch_name())
        }
    }
}

/// Parses torch names (`float32`, also `torch.float32` and the aliases `float`, `half`,
/// `double`, `long`, `int`, `short`) and safetensors names (`F32`).
impl FromStr for DType {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let name = s.strip_prefix("torch.").unwrap_or(s);
        for d in DType::ALL {
            if name == d.torch_name() || name == d.safetensors_name() {
                return Ok(d);
            }
        }
        Ok(match name {
            "float" => DType::F32,
            "double" => DType::F64,
            "half" => DType::F16,
            "long" => DType::I64,
            "int" => DType::I32,
            "short" => DType::I16,
            _ => {
                return Err(Error::Parse(format!(
                    "unknown dtype {s:?}; expected a torch name (float32, int64, bfloat16, ...) \
                     or a safetensors name (F32, I64, BF16, ...)"
                )))
            }
        })
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A Rust scalar type that can be a tensor element. Implemented for `bool`, `u8`, `i8`,
/// `i16`, `i32`, `i64`, `half::f16`, `half::bf16`, `f32` and `f64`.
///
/// The bytemuck bounds let the crate view raw bytes as elements without `unsafe`: every
/// bit pattern is valid for the numeric types, and `bool` is checked (0 or 1).
pub trait Element:
    bytemuck::CheckedBitPattern
    + bytemuck::NoUninit
    + Copy
    + Send
    + Sync
    + PartialEq
    + fmt::Debug
    + 'static
    + sealed::Sealed
{
    /// The dtype of this element type.
    const DTYPE: DType;
    /// The value zero (`false` for bool).
    const ZERO: Self;
    /// The value one (`true` for bool).
    const ONE: Self;
}

macro_rules! element {
    ($t:ty, $d:ident, $zero:expr, $one:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            const ZERO: Self = $zero;
            const ONE: Self = $one;
        }
    };
}

element!(bool, Bool, false, true);
element!(u8, U8, 0, 1);
element!(i8, I8, 0, 1);
element!(i16, I16, 0, 1);
element!(i32, I32, 0, 1);
element!(i64, I64, 0, 1);
element!(half::f16, F16, half::f16::ZERO, half::f16::ONE);
element!(half::bf16, BF16, half::bf16::ZERO, half::bf16::ONE);
element!(f32, F32, 0.0, 1.0);
element!(f64, F64, 0.0, 1.0);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(d.torch_name().parse::<DType>().unwrap(), d);
            assert_eq!(d.safetensors_name().parse::<DType>().unwrap(), d);
            assert_eq!(d.to_string(), d.torch_name());
            assert_eq!(format!("{d:#}"), d.safetensors_name());
        }
        assert_eq!("torch.float".parse::<DType>().unwrap(), DType::F32);
        assert!("float128".parse::<DType>().unwrap_err().to_string().contains("float128"));
    }

    #[test]
    fn sizes_match_rust_types() {
        assert_eq!(DType::F16.size(), std::mem::size_of::<half::f16>());
        assert_eq!(DType::BF16.size(), std::mem::size_of::<half::bf16>());
        assert_eq!(DType::I64.size(), std::mem::size_of::<i64>());
        assert_eq!(DType::Bool.size(), std::mem::size_of::<bool>());
    }
}
