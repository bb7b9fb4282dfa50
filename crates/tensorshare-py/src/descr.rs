//! torch's own C accessors, called directly: the getter of a getset descriptor and a method
//! descriptor, each looked up once on the C type that defines it (`torch._C.TensorBase`,
//! `torch._C.StorageBase`) and checked there: the type is a static type with that name, and
//! the descriptor is that type's own, of the expected kind and with the expected name.
//!
//! Two reasons. What is called is torch's C code, whatever a program has since done to
//! torch's Python classes (`torch.Tensor` is a Python class anyone may patch), or to the
//! names these were looked up by. (torch's C code may itself hand a call to a torch function
//! mode that the program set up, which can answer anything: what memory safety needs from
//! these answers is checked again in Rust, a tensor's geometry against its block.) And a call
//! skips what `obj.name` costs every time: the lookup through the instance's type and its
//! `__dict__`, and for a method the bound method in between; on the hot path of a queue that
//! is a dozen reads per tensor.

use std::ffi::CStr;
use std::os::raw::c_char;

use pyo3::exceptions::{PyKeyError, PyRuntimeError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyType;

fn type_name(t: &Bound<'_, PyType>) -> String {
    t.fully_qualified_name().map_or_else(|_| "?".into(), |n| n.to_string())
}

/// Whether the C string `s` is `name`.
///
/// # Safety
/// `s` must be null or point to a NUL-terminated string that lives for the call.
unsafe fn is_named(s: *const c_char, name: &str) -> bool {
    // SAFETY: the caller's promise; a null pointer is no name.
    !s.is_null() && unsafe { CStr::from_ptr(s) }.to_bytes() == name.as_bytes()
}

/// `obj`, which must be a function defined in C (a `builtin_function_or_method`, which Python
/// code can neither make nor subclass) named `name`: a function a program put in torch's
/// place is refused, as [`c_type`] refuses a class.
pub(crate) fn c_function<'py>(obj: Bound<'py, PyAny>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    let named = obj.is_exact_instance_of::<pyo3::types::PyCFunction>()
        && obj.getattr("__name__")?.extract::<String>().is_ok_and(|n| n == name);
    if !named {
        return Err(PyRuntimeError::new_err(format!("{} is not torch's C function {name}", obj.repr()?)));
    }
    Ok(obj)
}

/// `obj`, which must be the static type named `name` (as C code defines types: a class
/// statement or `type()` makes heap types only, so no Python code can make one that passes).
pub(crate) fn c_type<'py>(obj: Bound<'py, PyAny>, name: &str) -> PyResult<Bound<'py, PyType>> {
    let ty = obj.cast_into::<PyType>()?;
    let p = ty.as_type_ptr();
    // SAFETY: `p` is a live type object, held by `ty`. `tp_flags` and `tp_name` are fields of
    // every type object; `tp_name` is a NUL-terminated string that lives as long as its type.
    let ok = unsafe { (*p).tp_flags & ffi::Py_TPFLAGS_HEAPTYPE == 0 && is_named((*p).tp_name, name) };
    if !ok {
        return Err(PyRuntimeError::new_err(format!("{} is not torch's C type {name}", type_name(&ty))));
    }
    Ok(ty)
}

/// The descriptor `name` defined by `owner` itself (not inherited, not a subclass's).
fn own<'py>(owner: &Bound<'py, PyType>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    owner.getattr("__dict__")?.get_item(name).map_err(|e| {
        if e.is_instance_of::<PyKeyError>(owner.py()) {
            PyRuntimeError::new_err(format!("{} has no {name} of its own", type_name(owner)))
        } else {
            e
        }
    })
}

/// Whether `obj`'s type is `owner` or derives from it, by the type's MRO: what CPython
/// itself checks before it calls a descriptor of `owner` on `obj` (`descr_check`), and what
/// guarantees that `obj` has `owner`'s C layout, since CPython refuses a base, an MRO or a
/// `__class__` whose layout does not fit. (`isinstance` would ask `__instancecheck__`, which
/// a metaclass may override.)
fn is_instance(obj: &Bound<'_, PyAny>, owner: &Bound<'_, PyType>) -> bool {
    // SAFETY: both pointers are live objects, held by the borrows; PyType_IsSubtype only
    // reads the first type's MRO.
    unsafe { ffi::PyType_IsSubtype(ffi::Py_TYPE(obj.as_ptr()), owner.as_type_ptr()) != 0 }
}

/// The getter of a getset descriptor that a C type defines.
pub(crate) struct Getter {
    /// A `getset_descriptor` whose `d_type` is `owner`, named `name`, with a getter
    /// (checked in [`Getter::new`]); held, so it stays where it is.
    descr: Py<PyAny>,
    owner: Py<PyType>,
    name: &'static str,
}

impl Getter {
    /// The getter `name` of `owner`, a type checked by [`c_type`].
    pub(crate) fn new(owner: &Bound<'_, PyType>, name: &'static str) -> PyResult<Getter> {
        let descr = own(owner, name)?;
        let p = descr.as_ptr();
        // SAFETY: `p` is a live object (held by `descr`). Its fields are read as those of a
        // `PyGetSetDescrObject` only once its type is `PyGetSetDescr_Type` exactly: that type
        // cannot be subclassed and has no constructor, so the only objects of it are those
        // CPython made with that layout (`PyDescr_NewGetSet`), whose `d_getset` points to the
        // `PyGetSetDef` of their type, which lives as long as the type, and whose `name` is
        // a NUL-terminated string of that definition. None of these fields can be changed
        // from Python.
        let ok = unsafe {
            ffi::Py_TYPE(p) == &raw mut ffi::PyGetSetDescr_Type && {
                let d = p.cast::<ffi::PyGetSetDescrObject>();
                let def = (*d).d_getset;
                (*d).d_common.d_type == owner.as_type_ptr()
                    && (*def).get.is_some()
                    && is_named((*def).name, name)
            }
        };
        if !ok {
            return Err(PyRuntimeError::new_err(format!("{}.{name} is not its C getter", type_name(owner))));
        }
        Ok(Getter { descr: descr.unbind(), owner: owner.clone().unbind(), name })
    }

    /// `obj.<name>`, as the C getter reports it; a `TypeError` when `obj` is not an instance
    /// of the owner.
    pub(crate) fn get<'py>(&self, obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let py = obj.py();
        let owner = self.owner.bind(py);
        if !is_instance(obj, owner) {
            return Err(PyTypeError::new_err(format!(
                "{}.{} of a {}",
                type_name(owner),
                self.name,
                type_name(&obj.get_type())
            )));
        }
        let p = self.descr.as_ptr();
        // SAFETY: `descr` is a getset descriptor of `owner` with a getter (checked in `new`;
        // the descriptor is held, and its `PyGetSetDef` lives with `owner`, a static type),
        // and `obj` is an instance of `owner` by its MRO, so it has the C layout the getter
        // was written for: the call is the one CPython's `getset_get` makes after the same
        // check, with the GIL held (`py`). The getter returns a new reference, or NULL with
        // an exception set, which `from_owned_ptr_or_err` takes as such.
        unsafe {
            let def = (*p.cast::<ffi::PyGetSetDescrObject>()).d_getset;
            let Some(get) = (*def).get else { unreachable!("checked in Getter::new") };
            Bound::from_owned_ptr_or_err(py, get(obj.as_ptr(), (*def).closure))
        }
    }
}

/// A method descriptor that a C type defines, called with the instance as its first
/// argument: CPython checks that the instance is one of the descriptor's type before the C
/// function runs, and [`Method::new`] that this type is the owner.
pub(crate) struct Method(Py<PyAny>);

impl Method {
    /// The method `name` of `owner`, a type checked by [`c_type`].
    pub(crate) fn new(owner: &Bound<'_, PyType>, name: &str) -> PyResult<Method> {
        let descr = own(owner, name)?;
        let p = descr.as_ptr();
        // SAFETY: as in `Getter::new`: the fields are read as those of a
        // `PyMethodDescrObject` only once the object's type is `PyMethodDescr_Type` exactly,
        // whose objects CPython alone makes (`PyDescr_NewMethod`), with `d_method` pointing
        // to the `PyMethodDef` of their type and its `ml_name` a NUL-terminated string.
        let ok = unsafe {
            ffi::Py_TYPE(p) == &raw mut ffi::PyMethodDescr_Type && {
                let d = p.cast::<ffi::PyMethodDescrObject>();
                (*d).d_common.d_type == owner.as_type_ptr() && is_named((*(*d).d_method).ml_name, name)
            }
        };
        if !ok {
            return Err(PyRuntimeError::new_err(format!("{}.{name} is not its C method", type_name(owner))));
        }
        Ok(Method(descr.unbind()))
    }

    /// `obj.<name>()`.
    pub(crate) fn call0<'py>(&self, obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        self.0.bind(obj.py()).call1((obj,))
    }

    /// `obj.<name>(arg)`.
    pub(crate) fn call1<'py>(
        &self,
        obj: &Bound<'py, PyAny>,
        arg: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.0.bind(obj.py()).call1((obj, arg))
    }

    /// The descriptor, to call with the instance first and then the arguments.
    pub(crate) fn bind<'py>(&self, py: Python<'py>) -> &Bound<'py, PyAny> {
        self.0.bind(py)
    }
}
