"""Tests of zeroshard/app/."""
